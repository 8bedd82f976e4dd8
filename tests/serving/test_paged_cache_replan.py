"""PagedKVCache.plan of a batch whose composition changed, as a serving engine re-plans between steps.

The cache keeps each sequence's sink and window tokens at its batch position and its body in the pages the table
names. A re-plan that moved a held sequence to another position (a batch compacted after one finished, the lengths
agreeing) read the plain tokens of the sequence that used to sit there with the body of the moved one: a silently
wrong cache. It is refused by name where the moved sequence's first pages (those its body fills, or its first one
while its body fills none) differ; a re-plan that keeps positions and first pages (pages changed after them) is
taken.

Fresh random data; target "reference" (float64 attention over the dequantized cache) and Triton's interpreter.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import InputError
from foldc.serving import PagedKVCache
from foldc.testing import rel_l2

A = foldc.Affine
S = foldc.AttentionSpec
SPEC = S(4, 2, 64, A(4, "token", 32), A(4, "channel", 16))
PAGE = 16
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning",
                                        "ignore:divide by zero encountered in log2:RuntimeWarning")


def _table(owned: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.tensor([0] + [len(p) for p in owned], dtype=torch.int32).cumsum(0).to(torch.int32)
    return indptr, torch.tensor([p for pages in owned for p in pages], dtype=torch.int32)


def _filled(gen, sink: int, window: int, tokens: int, target: str):
    """A cache of three sequences of ``tokens`` tokens each, two pages apiece (pages shuffled)."""
    cache = PagedKVCache(SPEC, num_layers=1, page_size=PAGE, num_pages=10, max_seq_len=2 * PAGE, sink=sink,
                         window=window, target=target)
    pages = torch.randperm(10, generator=gen).tolist()
    owned = [pages[0:2], pages[2:4], pages[4:6]]
    cache.plan(*_table(owned), seq_lens=[0, 0, 0])
    k = (torch.randn(3, 2, tokens, 64, generator=gen) * 2).half()
    v = (torch.randn(3, 2, tokens, 64, generator=gen) + 0.5).half()
    cache.append(0, k, v)
    return cache, owned, pages[6:], k, v


@settings(max_examples=6, deadline=None)
@given(sink=st.integers(0, 3), window=st.integers(1, 5), extra=st.integers(0, 8), short=st.booleans(),
       gone=st.integers(0, 1), seed=st.integers(0, 2**31 - 1))
def test_a_replan_that_moves_a_held_sequence_to_another_position_is_refused(sink, window, extra, short, gone, seed):
    """Sequence ``gone`` finished and the last one moved into its place with the same length: the cache read the
    moved sequence's body with the sink and window tokens of the one that finished (no error). ``short``: the
    sequences' tokens are all plain (no body yet), told apart by their first pages."""
    gen = torch.Generator().manual_seed(seed)
    # the body fills at least one page (one channel group: 16 tokens), or (short) is empty
    tokens = 1 + extra % (sink + window) if short else sink + window + PAGE + extra
    cache, owned, _, k, v = _filled(gen, sink, window, tokens, "reference")
    m = cache.body_len(tokens)
    assert (m == 0 if short else m >= PAGE) and tokens > m
    before_k, before_v, lens = cache.dequantized(0)
    moved = [owned[2] if b == gone else owned[b] for b in range(2)]   # the last sequence moved into the hole
    with pytest.raises(InputError, match=rf"seq_lens\[{gone}\]={tokens}: sequence {gone} began with pages "
                                         rf"\[{owned[gone][0]}(, {owned[gone][1]})?\] .* {m} quantized tokens\) but "
                                         rf"this table gives it \[{owned[2][0]}.* sink and window tokens are kept at "
                                         r"its batch position: a held sequence moved"):
        cache.plan(*_table(moved), seq_lens=[tokens, tokens])
    # the refused plan changed nothing: the cache still holds the three sequences as they were
    after_k, after_v, after_lens = cache.dequantized(0)
    assert after_lens == lens == [tokens] * 3
    assert torch.equal(after_k, before_k) and torch.equal(after_v, before_v)
    plain = min(sink, tokens)
    assert torch.equal(after_k[:, :, :plain], k[:, :, :plain].float())   # (the plain sink, bit for bit)
    q = torch.randn(3, 4, 64, generator=gen).half()
    assert rel_l2(cache.attention(0, q), foldc.attention_reference(q, before_k, before_v)) <= 1e-3


@pytest.mark.parametrize("target", ["reference", "interpret"])
def test_a_replan_that_keeps_positions_and_filled_pages_is_taken(target):
    """Reserved pages past a body's filled ones may change, the last sequence may leave and a new one start where a
    sequence finished (restarted with 0): the held tokens stay as they were and attention over them is right."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    tokens = 2 + 3 + PAGE + 1
    cache, owned, spare, k, v = _filled(gen, 2, 3, tokens, target)
    before_k, before_v, _ = cache.dequantized(0)
    # sequence 0 keeps its filled page and swaps its reserved one; sequence 1 starts anew; sequence 2 leaves
    cache.plan(*_table([owned[0][:1] + spare[:1], owned[1]]), seq_lens=[tokens, 0])
    k2 = torch.randn(2, 2, 1, 64, generator=gen).half()
    v2 = (torch.randn(2, 2, 1, 64, generator=gen) + 0.5).half()
    cache.append(0, k2, v2)
    got_k, got_v, lens = cache.dequantized(0)
    assert lens == [tokens + 1, 1]
    assert torch.equal(got_k[0, :, :tokens], before_k[0]) and torch.equal(got_v[0, :, :tokens], before_v[0])
    assert torch.equal(got_k[0, :, tokens], k2[0, :, 0].float()) and torch.equal(got_k[1, :, 0], k2[1, :, 0].float())
    q = torch.randn(2, 4, 64, generator=gen).half()
    ref = foldc.attention_reference(q, got_k, got_v, seq_lens=torch.tensor(lens))
    assert rel_l2(cache.attention(0, q), ref) <= 2e-3
