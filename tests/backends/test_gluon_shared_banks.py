"""Shared-memory bank conflicts of the tiles the kernels read, counted from the production layouts themselves
(CPU, no build): a shared load is served in wavefronts, each reaching one 32-bit word per bank; lanes that read
different words of one bank take one wavefront each. A 32-bit load serves all 32 lanes at once, a 128-bit load
eight lanes at a time. The reads counted here are the ones whose placement was chosen for it (docs/perf.md "head_dim
64 and head_dims between powers of two", docs/gemm.md "The activation tile's bank conflicts")."""
from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

from foldc.backends.gluon import gemv  # noqa: E402
from foldc.backends.gluon import kernel  # noqa: E402
from foldc.backends.gluon.operands import NARROW_WORDS  # noqa: E402
from foldc.backends.gluon.tile_operands import value_tile_words, value_words_layout  # noqa: E402

BANKS = 32


def _xor(bases, index: int) -> list[int]:
    """The coordinate a linear layout gives ``index`` (XOR of the bases of its set bits)."""
    coord = [0] * len(bases[0])
    for bit, base in enumerate(bases):
        if index >> bit & 1:
            coord = [c ^ b for c, b in zip(coord, base)]
    return coord


def word_offsets(smem, rows: int, cols: int) -> dict[tuple[int, int], int]:
    """(row, col) -> 32-bit word offset of a [rows, cols] tile of 32-bit words in ``smem``: a SharedLinearLayout
    (offset bits -> coordinates, inverted here) or a row-major SwizzledSharedLayout."""
    if hasattr(smem, "offset_bases"):
        offsets = {tuple(_xor(smem.offset_bases, o)): o for o in range(rows * cols)}
        assert len(offsets) == rows * cols, "the layout must place each word once"
        return offsets
    assert list(smem.order) == [1, 0]
    out = {}
    for r in range(rows):
        phase = (r // smem.per_phase) % smem.max_phase
        for c in range(cols):
            out[(r, c)] = r * cols + ((c // smem.vec) ^ phase) % (cols // smem.vec) * smem.vec + c % smem.vec
    return out


def wavefronts(addresses: list[set[int]]) -> int:
    """Wavefronts of one group of lanes, each lane reading the words in its set."""
    per_bank: dict[int, set[int]] = {}
    for words in addresses:
        for w in words:
            per_bank.setdefault(w % BANKS, set()).add(w)
    return max(len(words) for words in per_bank.values())


def value_read_wavefronts(smem, BN: int, WT: int) -> list[int]:
    """Wavefronts of each LDS.32 of `load_value_words`: the tile [BN, WT] read as [WT, BN] in value_words_layout,
    one load per register, every lane one word."""
    layout = value_words_layout(BN, WT)
    offsets = word_offsets(smem, BN, WT)
    counts = []
    for reg in range(1 << len(layout.reg_bases)):
        lanes = []
        for lane in range(32):
            w, t = [a ^ b for a, b in zip(_xor(layout.reg_bases, reg), _xor(layout.lane_bases, lane))]
            lanes.append({offsets[(t, w)]})
        counts.append(wavefronts(lanes))
    return counts


@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_four_word_value_tokens_read_in_one_wavefront(block_n):
    """INT2 at head_dim 64 (four words a token, copied twice into an eight-word tile): every value read meets
    32 consecutive words."""
    fields = 4   # 2-bit codes
    smem = kernel._value_smem(fields, block_n, NARROW_WORDS)
    counts = value_read_wavefronts(smem, block_n, value_tile_words(NARROW_WORDS))
    assert counts and set(counts) == {1}


@pytest.mark.parametrize("words", [8, 16])
def test_wider_value_tokens_stored_token_by_token_take_four(words):
    """Eight words a token and more keep the token-by-token tile (lane order measured slower there): the four
    tokens t, t + 8, t + 16, t + 24 a read spans share each bank, four wavefronts, as Nsight Compute counted."""
    smem = kernel._value_smem(4, 64, words)
    assert not hasattr(smem, "offset_bases")
    assert set(value_read_wavefronts(smem, 64, words)) == {4}


def test_the_value_copies_fill_the_tile_the_reads_expect():
    """The copy layout of four-word tokens covers each (token, word) of the tile once, sixteen bytes a lane
    (four consecutive words), so the copies write exactly the words the reads then take."""
    BN = 64
    WT = value_tile_words(NARROW_WORDS)
    copy = kernel.value_copy_layout(4, BN, NARROW_WORDS)
    seen = set()
    for lane in range(32):
        for reg in range(1 << len(copy.reg_bases)):
            seen.add(tuple(a ^ b for a, b in zip(_xor(copy.reg_bases, reg), _xor(copy.lane_bases, lane))))
    assert seen == {(t, w) for t in range(BN) for w in range(WT)}
    # registers 0-3 of a lane: four consecutive words of one token (one 16-byte cp.async)
    assert copy.reg_bases[:2] == [[0, 1], [0, 2]]


@pytest.mark.parametrize("d", [128, 256, 512])
def test_the_gemv_activation_tile_reads_at_the_least_wavefronts(d):
    """m > 8 (4-bit codes): the MMA's B operand reads a 32-k block of eight rows of the fp16 activation tile
    [16, d] in one LDS.128, lane 4n + u on row n's 16-byte unit u, served eight lanes at a time: 4 wavefronts
    (512 bytes) a read is the least, and the tile's 64-byte swizzle by the row's parity reaches it."""
    layout = gemv.x_rows_tile_layout()
    rows = 16
    # fp16 elements -> 32-bit words: the swizzle's units are whole words (vec is even)
    assert layout.vec % 2 == 0
    words = type("Words", (), dict(order=layout.order, per_phase=layout.per_phase, max_phase=layout.max_phase,
                                   vec=layout.vec // 2))
    offsets = word_offsets(words, rows, d // 2)
    per_read = []
    for tile in range(rows // 8):
        for block in range(d // 32):
            total = 0
            for quarter in range(4):
                lanes = []
                for lane in range(8 * quarter, 8 * quarter + 8):
                    row, col = lane // 4 + 8 * tile, (32 * block + 8 * (lane % 4)) // 2
                    lanes.append({offsets[(row, c)] for c in range(col, col + 4)})
                total += wavefronts(lanes)
            per_read.append(total)
    assert set(per_read) == {4}
    # the 16-byte swizzle by the row modulo 8 it replaced takes 8 (the model is not blind to conflicts)
    old = type("Words", (), dict(order=[1, 0], per_phase=1, max_phase=8, vec=4))
    offsets = word_offsets(old, rows, d // 2)
    lanes = [{offsets[(lane // 4, c)] for c in range(4 * (lane % 4), 4 * (lane % 4) + 4)} for lane in range(8)]
    assert 4 * wavefronts(lanes) == 8
