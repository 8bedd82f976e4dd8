"""Variants of the merging decode's grid barrier (foldc/backends/gluon/split_merge.py), for
`benchmarks/grid_merge.py --variants`: each a `merge_splits` with its own barrier before production's merge share,
swapped into the production kernel by `foldc.bench.rebound` (the rest of the kernel's source as it is).

- ``packed``: one int64 word, COUNTERS[1], arrivals in its low 32 bits and the generation in its high 32: each program
  adds 1; the one whose add returns ``programs - 1`` adds ``2**32 - programs`` (generation up, arrivals back to
  zero) in the same word; every program waits for the high bits to move. Two dependent atomics from the last
  arrival to the release, against production's three (its group's count, the groups' count, the generation), at
  the price of every arrival on one address. The buffer keeps production's invariants (COUNTERS[0] and the groups'
  counts stay zero; COUNTERS[1] only grows).
- ``sleep``: production's barrier whose wait sleeps 64 ns between polls (`nanosleep`), so that the spinning
  programs' loads do not queue ahead of the last arrivals' atomics in the L2.

Import only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from foldc.backends.gluon import split_merge

BARRIER_FIXED = gl.constexpr(split_merge.BARRIER_FIXED.value)
SPLIT_BLOCK = gl.constexpr(split_merge.SPLIT_BLOCK.value)
D_BLOCK = gl.constexpr(split_merge.D_BLOCK.value)


@gluon.jit
def packed_barrier(COUNTERS, b):
    programs = gl.num_programs(0) * gl.num_programs(1) * gl.num_programs(2)
    gl.thread_barrier()
    word = COUNTERS + 1
    old = gl.atomic_add(word, 1, sem="acq_rel", scope="gpu")
    if (old & 0xFFFFFFFF) == programs - 1:   # the last arrival: the generation up, the arrivals back to zero
        gl.atomic_add(word, 4294967296 - programs.to(gl.int64), sem="release", scope="gpu")
    gen0 = old >> 32
    gen = gl.atomic_add(word, 0, sem="acquire", scope="gpu") >> 32
    while gen == gen0:
        gen = gl.atomic_add(word, 0, sem="acquire", scope="gpu") >> 32
    gl.thread_barrier()


@gluon.jit
def _sleep(x):
    gl.inline_asm_elementwise("nanosleep.u32 64; mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def sleep_barrier(COUNTERS, b):
    heads = gl.num_programs(1)
    splits = gl.num_programs(2)
    groups = gl.num_programs(0) * heads
    gl.thread_barrier()
    gen0 = gl.atomic_add(COUNTERS + 1, 0, sem="relaxed", scope="gpu")
    group = COUNTERS + BARRIER_FIXED + b * heads + gl.program_id(1)
    old = gl.atomic_add(group, 1, sem="acq_rel", scope="gpu")
    if old == splits - 1:
        gl.store(group, 0)
        arrived = gl.atomic_add(COUNTERS, 1, sem="acq_rel", scope="gpu")
        if arrived == groups - 1:
            gl.store(COUNTERS, 0)
            gl.atomic_add(COUNTERS + 1, 1, sem="release", scope="gpu")
    gen = gl.atomic_add(COUNTERS + 1, 0, sem="acquire", scope="gpu")
    while gen == gen0:
        _sleep(gen.to(gl.int32))
        gen = gl.atomic_add(COUNTERS + 1, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def merge_share(OUT, LSE, WS_M, WS_L, WS_ACC, b, s, ROWS: gl.constexpr, DR: gl.constexpr, REAL_ROWS: gl.constexpr):
    """split_merge.merge_splits after its barrier, as it is there (production keeps one function: split in two
    there, three merging builds' SASS moved)."""
    heads = gl.num_programs(1)
    splits = gl.num_programs(2)
    groups = gl.num_programs(0) * heads
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [gl.num_warps(), 1], [1, 0])
    sl: gl.constexpr = gl.SliceLayout(1, blk)
    cl: gl.constexpr = gl.SliceLayout(0, blk)
    NDB: gl.constexpr = DR // D_BLOCK
    sb = gl.arange(0, SPLIT_BLOCK, layout=sl)
    cols = gl.arange(0, D_BLOCK, layout=cl)
    programs = groups * splits
    items = groups * REAL_ROWS * NDB
    for item in range((b * heads + gl.program_id(1)) * splits + s, items, programs):
        dblk = item % NDB
        row = (item // NDB) % REAL_ROWS
        head = item // (NDB * REAL_ROWS)   # the group: (sequence, head program)
        base = head.to(gl.int64) * splits * ROWS + row
        c = dblk * D_BLOCK + cols
        m = gl.max(gl.full([SPLIT_BLOCK], float("-inf"), gl.float32, layout=sl), axis=0)
        den = gl.sum(gl.zeros([SPLIT_BLOCK], gl.float32, layout=sl), axis=0)
        acc = gl.zeros([D_BLOCK], gl.float32, layout=cl)
        for s0 in range(0, splits, SPLIT_BLOCK):
            live = (s0 + sb) < splits
            idx = base + (s0 + sb) * ROWS
            m_s = gl.load(WS_M + idx, mask=live, other=float("-inf"))
            l_s = gl.load(WS_L + idx, mask=live, other=0.0)
            acc_s = gl.load(WS_ACC + idx[:, None] * DR + c[None, :], mask=live[:, None], other=0.0)
            m_new = gl.maximum(m, gl.max(m_s, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)   # nothing yet: every weight is 0
            alpha = gl.exp2(m - m_safe)
            w = gl.exp2(m_s - m_safe)
            den = den * alpha + gl.sum(l_s * w, axis=0)
            acc = acc * alpha + gl.sum(acc_s * w[:, None], axis=0)
            m = m_new
        q_head = head.to(gl.int64) * REAL_ROWS + row
        gl.store(OUT + q_head * DR + c, (acc / den).to(OUT.dtype.element_ty))
        if dblk == 0:   # m is in log2 units
            gl.store(LSE + q_head, (m + gl.log2(den)) * 0.6931471805599453)


@gluon.jit
def merge_splits_packed(OUT, LSE, COUNTERS, WS_M, WS_L, WS_ACC, b, s, ROWS: gl.constexpr, DR: gl.constexpr,
                        REAL_ROWS: gl.constexpr):
    packed_barrier(COUNTERS, b)
    merge_share(OUT, LSE, WS_M, WS_L, WS_ACC, b, s, ROWS, DR, REAL_ROWS)


@gluon.jit
def merge_splits_sleep(OUT, LSE, COUNTERS, WS_M, WS_L, WS_ACC, b, s, ROWS: gl.constexpr, DR: gl.constexpr,
                       REAL_ROWS: gl.constexpr):
    sleep_barrier(COUNTERS, b)
    merge_share(OUT, LSE, WS_M, WS_L, WS_ACC, b, s, ROWS, DR, REAL_ROWS)


VARIANTS = {"packed": merge_splits_packed, "sleep": merge_splits_sleep}


def decode_kernel(name: str):
    """The production decode kernel whose merging build waits at barrier ``name`` ("production": itself)."""
    from foldc.backends.gluon.kernel import foldc_decode_gluon
    from foldc.bench import rebound

    if name == "production":
        return foldc_decode_gluon
    return rebound(foldc_decode_gluon, merge_splits=VARIANTS[name])
