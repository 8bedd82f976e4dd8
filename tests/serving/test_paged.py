"""Paged decode: the generated kernel reading through a page table (Triton's interpreter, fp16),
quantize-on-append into pages, and the page-table checks.

Every kernel result is compared with float64 attention (foldc.compile(spec, "reference"), the plan
executor) over the same cache gathered into contiguous storage; page tables are drawn at random
(shuffled pages, ragged lengths, partial last pages) with fresh random data in every page.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import InputError, InputTypeError, SpecError
from foldc.serving import PagedDecodeWrapper, append_paged, gather_pages, page_pool
from foldc.testing import bf16_attention, rel_l2

A = foldc.Affine
S = foldc.AttentionSpec
TOL = 2e-3
# small shapes the backend tiles at head_dim 64 (and 96): token- and channel-wise, INT2 and INT4
SPECS = {
    "K token2 / V channel4": S(4, 2, 64, A(2, "token", 32), A(4, "channel", 16)),
    "K channel2 / V token4": S(8, 2, 64, A(2, "channel", 32), A(4, "token", 64)),
    "K token4 / V token2": S(2, 1, 64, A(4, "token", 16), A(2, "token", 16)),
    "K channel4 / V channel2": S(4, 2, 64, A(4, "channel", 16), A(2, "channel", 32)),
    # head_dim 96 (Phi-3's): 24-channel bit fields at INT2, padded chunks in the kernel
    "K token2 / V token2 d96": S(4, 2, 96, A(2, "token", 96), A(2, "token", 48)),
}


def random_pools(spec, num_pages: int, page_size: int, gen):
    """Pools full of quantized random values (outlier key channels, offset values), page by page."""
    k = torch.randn(num_pages, spec.num_kv_heads, page_size, spec.head_dim, generator=gen)
    k[..., torch.randint(0, spec.head_dim, (2,), generator=gen)] *= 6.0
    v = torch.randn(num_pages, spec.num_kv_heads, page_size, spec.head_dim, generator=gen) + 0.5
    return foldc.quantize(k, spec.k), foldc.quantize(v, spec.v)


def random_table(batch: int, num_pages: int, page_size: int, gen, reserve: bool = False):
    """Shuffled distinct pages, 1..4 per sequence, ragged lengths with partial last pages."""
    counts = torch.randint(1, 5, (batch,), generator=gen)
    perm = torch.randperm(num_pages, generator=gen)[:int(counts.sum())]
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    last = torch.randint(1, page_size + 1, (batch,), generator=gen).to(torch.int32)
    return indptr, perm.to(torch.int32), last


def reference_over_pages(spec, q, k_pages, v_pages, indptr, indices, lens, page_size, sm_scale):
    k, _ = gather_pages(k_pages, indptr, indices, lens, page_size)
    v, _ = gather_pages(v_pages, indptr, indices, lens, page_size)
    ref = foldc.compile(spec, "reference")(q, k, v, sm_scale=sm_scale, seq_lens=torch.tensor(lens))
    return ref, k, v


@settings(max_examples=6, deadline=None)
@given(name=st.sampled_from(sorted(SPECS)), page_size=st.sampled_from([32, 64]), batch=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1))
@example(name="K token2 / V token2 d96", page_size=32, batch=2, seed=3)   # padded chunks, every run
def test_paged_kernel_matches_float64_over_random_page_tables(name, page_size, batch, seed):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(seed)
    num_pages = 4 * batch + 3
    k_pages, v_pages = random_pools(spec, num_pages, page_size, gen)
    indptr, indices, last = random_table(batch, num_pages, page_size, gen)
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=4 * page_size, target="interpret")
    table = wrapper.plan(indptr, indices, last, num_pages=num_pages)
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).half()
    sm_scale = spec.head_dim ** -0.5 * float(0.5 + torch.rand((), generator=gen))
    out = torch.full_like(q, float("nan"))
    got, lse = wrapper.run(q, k_pages, v_pages, sm_scale=sm_scale, out=out, return_lse=True)
    assert got is out and not torch.isnan(out).any()
    ref, k, v = reference_over_pages(spec, q, k_pages, v_pages, indptr, indices, table.seq_lens, page_size, sm_scale)
    err = rel_l2(got, ref)
    assert err <= TOL and err <= rel_l2(bf16_attention(q, k, v, sm_scale, torch.tensor(table.seq_lens)), ref), err
    _, ref_lse = foldc.compile(spec, "reference")(q, k, v, sm_scale=sm_scale, seq_lens=torch.tensor(table.seq_lens),
                                                  return_lse=True)
    assert torch.allclose(lse.double(), ref_lse, rtol=0, atol=1e-2)  # logits carry the fp16 MMA rounding
    # a float32 out holds the same output before its one rounding to q's dtype
    wide = wrapper.run(q, k_pages, v_pages, sm_scale=sm_scale, out=torch.empty(q.shape, dtype=torch.float32))
    assert wide.dtype == torch.float32 and torch.equal(wide.to(q.dtype), got)


@pytest.mark.parametrize("name", ["K token2 / V channel4", "K channel2 / V token4"])
def test_paged_equals_contiguous_bit_for_bit(name):
    """One split, one tile size: the paged kernel reads the same values in the same order as the
    contiguous kernel over the gathered cache, so the outputs are identical."""
    spec, page_size = SPECS[name], 32
    gen = torch.Generator().manual_seed(11)
    k_pages, v_pages = random_pools(spec, 9, page_size, gen)
    indptr = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    indices = torch.tensor([5, 0, 8, 2, 7, 1, 4], dtype=torch.int32)
    last = torch.tensor([17, 32, 1], dtype=torch.int32)
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=96, target="interpret", block_n=16, splits=1)
    table = wrapper.plan(indptr, indices, last, num_pages=9)
    q = torch.randn(3, spec.num_q_heads, spec.head_dim, generator=gen).half()
    paged = wrapper.run(q, k_pages, v_pages)
    k, lens = gather_pages(k_pages, indptr, indices, table.seq_lens, page_size)
    v, _ = gather_pages(v_pages, indptr, indices, table.seq_lens, page_size)
    contiguous = foldc.compile(spec, "interpret", block_n=16, splits=1)(q, k, v, seq_lens=lens)
    assert torch.equal(paged, contiguous)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's 0/0 and log2(0) of the empty sequence
def test_plain_pools_and_an_empty_sequence_merge_to_the_reference():
    """Plain (model-dtype) pools use the same generated kernel; a sequence with no pages gives
    lse = -inf and contributes nothing when merged with another part."""
    spec, page_size = S(4, 2, 64), 16
    gen = torch.Generator().manual_seed(5)
    pool_k = torch.randn(6, 2, page_size, 64, generator=gen).half()
    pool_v = (torch.randn(6, 2, page_size, 64, generator=gen) + 0.5).half()
    indptr = torch.tensor([0, 2, 2], dtype=torch.int32)
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=64, target="interpret")
    wrapper.plan(indptr, torch.tensor([4, 1], dtype=torch.int32), torch.tensor([9, 0], dtype=torch.int32),
                 num_pages=6)
    q = torch.randn(2, 4, 64, generator=gen).half()
    out, lse = wrapper.run(q, pool_k, pool_v, return_lse=True)
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    k, lens = gather_pages(pool_k, indptr, torch.tensor([4, 1], dtype=torch.int32), (25, 0), page_size)
    v, _ = gather_pages(pool_v, indptr, torch.tensor([4, 1], dtype=torch.int32), (25, 0), page_size)
    ref = foldc.attention_reference(q[:1], k[:1], v[:1], seq_lens=torch.tensor([25]))
    assert rel_l2(out[:1], ref) <= TOL
    other = (torch.randn(2, 4, 64, generator=gen).half(), torch.randn(2, 4, generator=gen))
    merged, total = foldc.merge_attention([(out, lse), other])
    assert torch.equal(merged[1], other[0][1]) and not torch.isnan(merged).any()


def test_a_query_or_plain_pool_that_records_gradients_gets_outputs_whose_backward_raises():
    """The wrapper's kernels have no backward: their output had no grad_fn, so a loss through it trained the rest
    of a model and never q (or a plain pool), silently. Now out and lse raise by name at backward, with the same
    values; under no_grad nothing changes."""
    from foldc.errors import UnsupportedError

    spec, page_size = S(4, 2, 64), 16
    gen = torch.Generator().manual_seed(6)
    pool_k = torch.randn(4, 2, page_size, 64, generator=gen).half()
    pool_v = torch.randn(4, 2, page_size, 64, generator=gen).half()
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=64, target="interpret")
    wrapper.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32),
                 torch.tensor([7], dtype=torch.int32), num_pages=4)
    q = torch.randn(1, 4, 64, generator=gen).half()
    plain, plain_lse = wrapper.run(q, pool_k, pool_v, return_lse=True)
    for q_grad, k_grad in ((True, False), (False, True)):
        qg, kg = q.clone().requires_grad_(q_grad), pool_k.clone().requires_grad_(k_grad)
        out, lse = wrapper.run(qg, kg, pool_v, return_lse=True)
        assert torch.equal(out.detach(), plain) and torch.equal(lse.detach(), plain_lse)
        for y in (out, lse, wrapper.run(qg, kg, pool_v)):
            with pytest.raises(UnsupportedError, match=r"^PagedDecodeWrapper\.run has no backward.*torch\.no_grad"):
                y.float().sum().backward()
        with torch.no_grad():
            assert not wrapper.run(qg, kg, pool_v).requires_grad
    assert not wrapper.run(q, pool_k, pool_v).requires_grad


def test_replan_reuses_the_device_buffers():
    """A later plan with the same batch writes into the same tensors (captured graphs stay valid)."""
    spec = SPECS["K token4 / V token2"]
    wrapper = PagedDecodeWrapper(spec, 16, max_seq_len=64, target="interpret")
    wrapper.plan(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([2, 0, 5], dtype=torch.int32),
                 torch.tensor([3, 16], dtype=torch.int32), num_pages=8)
    before = [t.data_ptr() for t in (wrapper.kv_indptr, wrapper.kv_indices, wrapper.seq_lens)]
    table = wrapper.plan(torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([7, 1, 3, 6], dtype=torch.int32),
                         torch.tensor([5, 1], dtype=torch.int32), num_pages=8)
    assert [t.data_ptr() for t in (wrapper.kv_indptr, wrapper.kv_indices, wrapper.seq_lens)] == before
    assert table.seq_lens == (21, 17) and wrapper.seq_lens.tolist() == [21, 17]
    assert wrapper.kv_indices[:4].tolist() == [7, 1, 3, 6]


@pytest.mark.parametrize("target", ["interpret", "reference"])
def test_a_plans_headroom_is_what_runs_read_after_the_appends_it_allows(target):
    """``plan(...).headroom`` (tokens every sequence can still append) counted the pages alone: a sequence owning
    pages past max_seq_len was given room the split partition does not cover, so after appending that many tokens
    a run read max_seq_len of them (0.18 off float64 here), silently. It is now the room both leave."""
    spec, page_size = SPECS["K token4 / V token2"], 32
    gen = torch.Generator().manual_seed(8)
    k_pages, v_pages = random_pools(spec, 8, page_size, gen)
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=64, target=target)
    indptr, indices = torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([3, 1, 5, 0, 6, 2], dtype=torch.int32)
    table = wrapper.plan(indptr, indices, None, num_pages=8, seq_lens=[40, 20])
    assert table.headroom == 24   # sequence 0: 24 tokens to max_seq_len (4 pages hold 88 more)
    for b, n in enumerate(table.seq_lens):   # the appends it allows, then every sequence at its new length
        x = (torch.randn(1, spec.num_kv_heads, table.headroom, spec.head_dim, generator=gen) + 0.5 * b).half()
        for pool, enc in ((k_pages, spec.k), (v_pages, spec.v)):
            append_paged(pool, x, indptr[b:b + 2] - indptr[b], indices[indptr[b]:indptr[b + 1]],
                         torch.tensor([n], dtype=torch.int32), page_size=page_size, target="interpret")
    lens = [n + table.headroom for n in table.seq_lens]
    q = torch.randn(2, spec.num_q_heads, spec.head_dim, generator=gen).half()
    got = wrapper.run(q, k_pages, v_pages, seq_lens=torch.tensor(lens, dtype=torch.int32))
    ref, _, _ = reference_over_pages(spec, q, k_pages, v_pages, indptr, indices, lens, page_size, None)
    assert rel_l2(got, ref) <= TOL


# ---- append into pages ----------------------------------------------------------------------------

@settings(max_examples=12, deadline=None)
@given(layout=st.sampled_from(["token", "channel"]), bits=st.sampled_from([2, 4]),
       scale_dtype=st.sampled_from([torch.float16, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_append_paged_writes_what_quantize_computes_and_nothing_else(layout, bits, scale_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    group, page_size, num_pages, batch = 16, 32, 10, 3
    enc = A(bits, layout, group, scale_dtype)
    spec = S(2, 2, 32, enc, enc)
    pool = page_pool(spec, "k", num_pages, page_size)
    for t in (pool.codes, pool.scale.view(torch.int16), pool.zero.view(torch.int16)):  # poison: random bits
        t.copy_(torch.randint(-128 if t.dtype != torch.uint8 else 0, 128 if t.dtype != torch.uint8 else 256,
                              t.shape, generator=gen, dtype=t.dtype))
    before = [t.clone() for t in (pool.codes, pool.scale, pool.zero)]
    indptr = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    indices = torch.randperm(num_pages, generator=gen)[:8].to(torch.int32)
    tokens = 32
    unit = group if layout == "channel" else 1
    start = (torch.randint(0, 40, (batch,), generator=gen) // unit * unit).to(torch.int32)
    counts = (torch.randint(0, tokens + 1, (batch,), generator=gen) // unit * unit).to(torch.int32)
    x = (torch.randn(batch, 2, tokens, 32, generator=gen) * 3 + 1).half()
    append_paged(pool, x, indptr, indices, start, page_size=page_size, counts=counts, target="interpret")
    want = [t.clone() for t in before]
    for b in range(batch):
        n = int(counts[b])
        if n == 0:
            continue
        q = foldc.quantize(x[b:b + 1, :, :n], enc)
        own = indices[indptr[b]:indptr[b + 1]].tolist()
        for t in range(n):
            pos = int(start[b]) + t
            if pos // page_size >= len(own):  # past the sequence's own pages: must not be written
                continue
            page, row = own[pos // page_size], pos % page_size
            want[0][page, :, row] = q.codes[0, :, t]
            if layout == "token":
                want[1][page, :, row], want[2][page, :, row] = q.scale[0, :, t], q.zero[0, :, t]
            elif t % group == 0:
                want[1][page, :, row // group] = q.scale[0, :, t // group]
                want[2][page, :, row // group] = q.zero[0, :, t // group]
    for part, got, w in zip(("codes", "scale", "zero"), (pool.codes, pool.scale, pool.zero), want):
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8)), part


def test_append_paged_never_writes_past_a_sequences_own_pages():
    enc = A(4, "token", 32)
    pool = page_pool(S(2, 2, 32, enc, enc), "k", 4, 16)
    x = torch.randn(1, 2, 8, 32).half()
    # sequence 0 owns page 2 only; tokens 12..19 would spill into a page it does not own
    append_paged(pool, x, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                 torch.tensor([12], dtype=torch.int32), page_size=16, target="interpret")
    written = (pool.scale != 0).any(-1)  # [pages, heads, rows]
    assert written[2, :, 12:].all() and not written[2, :, :12].any()
    assert not written[[0, 1, 3]].any()


@pytest.mark.parametrize("target", ["interpret", "reference"])
def test_append_paged_writes_only_whole_channel_groups_within_counts(target):
    """``counts[b]`` that is not a multiple of a channel-wise group_size: only the whole groups within it are
    written. The kernel wrote the group its count ended in whole (tokens past ``counts[b]``, e.g. padding, in
    the group's scale and codes), the reference quantized the partial group on its own: different bits."""
    gen = torch.Generator().manual_seed(21)
    enc = A(4, "channel", 16)
    pool = page_pool(S(2, 2, 32, enc, enc), "k", 6, 32)
    x = (torch.randn(3, 2, 32, 32, generator=gen) * 2 + 1).half()
    x[:, :, 24:] = 1e3   # what a caller would not count: padding past the tokens it meant
    counts = torch.tensor([8, 24, 32], dtype=torch.int32)
    append_paged(pool, x, torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([4, 0, 2], dtype=torch.int32),
                 torch.zeros(3, dtype=torch.int32), page_size=32, counts=counts, target=target)
    want = foldc.quantize(x, enc)
    assert not pool.codes[4].any() and not pool.scale[4].any()                 # 8 tokens: no whole group
    assert torch.equal(pool.codes[0, :, :16], want.codes[1, :, :16]) and not pool.codes[0, :, 16:].any()
    assert torch.equal(pool.scale[0, :, :1], want.scale[1, :, :1]) and not pool.scale[0, :, 1:].any()
    assert torch.equal(pool.codes[2], want.codes[2]) and torch.equal(pool.scale[2], want.scale[2])


@settings(max_examples=10, deadline=None)
@given(layout=st.sampled_from(["token", "channel"]), page=st.sampled_from([-3, -1, 4, 5, 7]),
       target=st.sampled_from(["interpret", "reference"]), seed=st.integers(0, 2**31 - 1))
@example(layout="token", page=-1, target="reference", seed=0)   # (was written into the pool's last page)
@example(layout="channel", page=4, target="reference", seed=0)   # (was an IndexError)
def test_append_paged_never_writes_outside_the_pool(layout, page, target, seed):
    """A page-table entry naming a page outside the pool (past its end or negative; the table of a caller who
    skipped `PagedDecodeWrapper.plan`'s check) is skipped: the pool is a view of the middle pages of a larger
    buffer, and nothing outside the view changes, nor the view's other pages (both kernels under the interpreter,
    and the reference target, which mirrors them)."""
    enc = A(4, layout, 16)
    big = page_pool(S(2, 2, 32, enc, enc), "k", 12, 16)
    gen = torch.Generator().manual_seed(seed)
    for t in (big.codes, big.scale, big.zero):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    before = [t.clone() for t in (big.codes, big.scale, big.zero)]
    pool = foldc.AffineTensor(big.codes[4:8], big.scale[4:8], big.zero[4:8], enc, 32)   # pages 4..7 of 12
    x = torch.randn(2, 2, 16, 32, generator=gen).half()
    # sequence 0 names a page outside the pool, sequence 1 its own page 2 (written as usual)
    append_paged(pool, x, torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([page, 2], dtype=torch.int32),
                 torch.zeros(2, dtype=torch.int32), page_size=16, target=target)
    for got, old in zip((big.codes, big.scale, big.zero), before):
        same = (got.view(torch.uint8) == old.view(torch.uint8)).flatten(1).all(1)   # per page of the buffer
        assert same[[p for p in range(12) if p != 6]].all() and not same[6]


# ---- errors ----------------------------------------------------------------------------------------

TOKEN_SPEC = SPECS["K token4 / V token2"]
CHANNEL_SPEC = SPECS["K token2 / V channel4"]  # V channel-wise, group_size 16


def _planned(spec=TOKEN_SPEC, page_size=16):
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=64, target="interpret")
    wrapper.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32),
                 torch.tensor([5], dtype=torch.int32), num_pages=4)
    return wrapper


@pytest.mark.parametrize("make, exc, match", [
    (lambda: PagedDecodeWrapper(CHANNEL_SPEC, 24, max_seq_len=64),
     SpecError, r"page_size=24 is not a multiple of group_size=16 .*use page_size=48"),
    (lambda: PagedDecodeWrapper(TOKEN_SPEC, 32, max_seq_len=64, block_n=64),
     SpecError, r"block_n=64 does not divide page_size=32"),
    (lambda: PagedDecodeWrapper(TOKEN_SPEC, 24, max_seq_len=64),
     SpecError, r"page_size=24 has no power-of-two divisor >= 16"),
    (lambda: PagedDecodeWrapper(TOKEN_SPEC, 0, max_seq_len=64), SpecError, r"page_size=0 must be a positive"),
    (lambda: _planned().plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 4], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32), num_pages=4),
     InputError, r"kv_indices\[1\]=4 points outside the pool of num_pages=4; .*\[0, 3\]"),
    (lambda: _planned().plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32), num_pages=4),
     InputError, r"kv_indices\[1\] lists page 1 again, as entry 1 of sequence 0, which holds 21 tokens: a page "
                 r"listed more than once must be full"),
    (lambda: _planned().plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32), num_pages=4),
     InputError, r"kv_indptr\[-1\]=3 but kv_indices holds 2 entries"),
    (lambda: _planned().plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
                             torch.tensor([17], dtype=torch.int32), num_pages=4),
     InputError, r"kv_last_page_len\[0\]=17 must lie in \[0, page_size=16\]"),
    (lambda: _planned().plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
                             torch.tensor([5, 5], dtype=torch.int32), num_pages=4),
     InputError, r"kv_last_page_len has 2 entries but kv_indptr describes batch=1"),
    # both lengths: seq_lens was ignored, silently (the run read the table's 21 tokens, not the 3 asked for)
    (lambda: _planned().plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32), num_pages=4, seq_lens=[3]),
     InputError, r"kv_last_page_len and seq_lens=\[3\] both give the lengths; pass one"),
    (lambda: page_pool(TOKEN_SPEC, "q", 4, 16), SpecError, r"name='q' must be 'k' or 'v'"),   # (an AttributeError)
    (lambda: page_pool(TOKEN_SPEC, "K", 4, 16), SpecError, r"name='K' must be 'k' or 'v'"),
    (lambda: PagedDecodeWrapper(TOKEN_SPEC, 16, max_seq_len=16).plan(
        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32), num_pages=4),
     InputError, r"holds 21 tokens but max_seq_len=16"),
    (lambda: PagedDecodeWrapper(TOKEN_SPEC, 16, max_seq_len=64).run(torch.zeros(1, 2, 64).half(), None, None),
     InputError, r"run\(\) before plan\(\)"),
])
def test_bad_configuration_and_page_tables_name_the_value_and_the_fix(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def _pools(spec=TOKEN_SPEC, pages=4, page_size=16):
    return page_pool(spec, "k", pages, page_size), page_pool(spec, "v", pages, page_size)


@pytest.mark.parametrize("args, exc, match", [
    (lambda: (torch.zeros(1, 4, 64).half(), *_pools()), InputError, r"q shape=\(1, 4, 64\) but .* \(1, 2, 64\)"),
    (lambda: (torch.zeros(1, 2, 64, dtype=torch.bfloat16), *_pools()), InputError,
     r"q dtype=torch.bfloat16 is not supported by target='interpret'"),
    (lambda: (torch.zeros(1, 2, 64).half(), *_pools(S(4, 2, 64, TOKEN_SPEC.k, TOKEN_SPEC.v))), InputError,
     r"k_pages shape=\(4, 2, 16, 64\) but the plan needs \(4, 1, 16, 64\)"),
    (lambda: (torch.zeros(1, 2, 64).half(), _pools(pages=5)[0], _pools()[1]), InputError,
     r"k_pages shape=\(5, 1, 16, 64\) but the plan needs \(4, 1, 16, 64\)"),
    (lambda: (torch.zeros(1, 2, 64).half(), _pools(S(2, 1, 64, A(4, "channel", 16), None))[0], _pools()[1]),
     InputError, r"k_pages is encoded as channel:4:16 but the spec says token:4:16"),
    (lambda: (torch.zeros(1, 2, 64).half(), torch.zeros(4, 1, 16, 64).half(), _pools()[1]), InputTypeError,
     r"k_pages must be a foldc.AffineTensor pool encoded as token:4:16"),
])
def test_bad_run_arguments_name_the_value_and_the_fix(args, exc, match):
    wrapper = _planned()
    with pytest.raises(exc, match=match):
        wrapper.run(*args())


def test_plain_pool_dtype_must_match_the_query():
    wrapper = PagedDecodeWrapper(S(2, 1, 64), 16, max_seq_len=64, target="interpret")
    wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                 torch.tensor([3], dtype=torch.int32), num_pages=2)
    pool = torch.zeros(2, 1, 16, 64)
    with pytest.raises(InputError, match=r"k_pages dtype=torch.float32 must match q dtype=torch.float16"):
        wrapper.run(torch.zeros(1, 2, 64).half(), pool, pool)


def test_append_paged_rejects_a_partial_channel_group_and_a_wrong_page_size():
    enc = A(2, "channel", 16)
    pool = page_pool(S(2, 2, 32, enc, enc), "v", 4, 32)
    table = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.zeros(1, dtype=torch.int32))
    with pytest.raises(InputError, match=r"x holds 8 tokens, not a multiple of group_size=16"):
        append_paged(pool, torch.randn(1, 2, 8, 32).half(), *table, page_size=32, target="interpret")
    with pytest.raises(SpecError, match=r"page_size=24 is not a multiple of group_size=16"):
        append_paged(pool, torch.randn(1, 2, 16, 32).half(), *table, page_size=24, target="interpret")
    with pytest.raises(InputError, match=r"x shape=\(1, 3, 16, 32\) but the pool needs \[batch, 2, tokens, 32\]"):
        append_paged(pool, torch.randn(1, 3, 16, 32).half(), *table, page_size=32, target="interpret")
    assert math.isclose(float(pool.scale.abs().sum()), 0.0)  # nothing was written


def test_a_non_contiguous_pool_and_a_device_mismatch_are_refused():
    wrapper = _planned()
    k, v = _pools()
    wide = torch.zeros(*k.codes.shape[:3], 2 * k.codes.shape[3], dtype=torch.uint8)
    strided = foldc.AffineTensor(wide[..., :k.codes.shape[3]], k.scale, k.zero, k.encoding, k.head_dim)
    with pytest.raises(InputError, match=r"k_pages must be contiguous"):
        wrapper.run(torch.zeros(1, 2, 64).half(), strided, v)
    with pytest.raises(SpecError, match=r"target='sm_90' runs on a CUDA GPU, but device=cpu"):
        PagedDecodeWrapper(TOKEN_SPEC, 16, max_seq_len=64, target="sm_90")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_a_cuda_device_without_a_gpu_is_refused_by_name():
    """target='auto' with device='cuda' where torch sees no GPU: the error names the device, not the target the
    user already left at 'auto'."""
    from foldc.serving import PagedKVCache, QuantizedKVCache

    for make in (lambda: PagedDecodeWrapper(TOKEN_SPEC, 16, max_seq_len=64, device="cuda"),
                 lambda: QuantizedKVCache(TOKEN_SPEC, 1, 64, device="cuda"),
                 lambda: PagedKVCache(TOKEN_SPEC, num_layers=1, page_size=16, num_pages=4, max_seq_len=64,
                                      device="cuda:1")):
        with pytest.raises(SpecError, match=r"device='cuda(:1)?' but torch finds no CUDA GPU; use device='cpu'"):
            make()


@pytest.mark.parametrize("target", ["reference", "auto", "interpret"])
def test_a_meta_device_is_refused_where_the_cache_is_built(target):
    """A cache or wrapper on the meta device was built under target='reference' and its first append raised
    NotImplementedError ("Cannot copy out of meta tensor") from inside torch; under target='auto' the error said
    "use target='auto'", the target given. It is a SpecError naming the device where it is built now."""
    from foldc.serving import PagedKVCache, QuantizedKVCache

    for make in (lambda: PagedDecodeWrapper(TOKEN_SPEC, 16, max_seq_len=64, device="meta", target=target),
                 lambda: QuantizedKVCache(TOKEN_SPEC, 1, 64, device=torch.device("meta"), target=target),
                 lambda: PagedKVCache(TOKEN_SPEC, num_layers=1, page_size=16, num_pages=4, max_seq_len=64,
                                      device="meta", target=target)):
        with pytest.raises(SpecError, match=r"device=.*meta.* holds no values, and a cache stores tokens and reads "
                                            r"them back; use device='cpu'"):
            make()


def test_a_bare_cuda_device_means_the_current_gpu():
    """``device="cuda"`` must compare equal to the device of tensors made there (cuda:0), or every
    device check of the caches would refuse their own tensors."""
    from foldc.serving.cache import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda") == torch.zeros(1, device="cuda").device
    with pytest.raises(SpecError, match=r"device='gpu0' is not a torch device"):
        resolve_device("gpu0")


def test_a_dequant_plan_reads_pages_too():
    """Plans that reconstruct values (break-even fails: group_size <= 2 x query heads per KV head)
    go through the same per-tile page bases."""
    spec, page_size = S(32, 2, 64, A(2, "token", 16), A(4, "channel", 16)), 32
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=96, target="interpret")
    assert set(wrapper.attention.plan_for(torch.float16).folds.values()) == {"dequant"}
    gen = torch.Generator().manual_seed(13)
    k_pages, v_pages = random_pools(spec, 7, page_size, gen)
    indptr, indices, last = (torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([6, 2, 0, 4, 1], dtype=torch.int32),
                             torch.tensor([9, 32], dtype=torch.int32))
    table = wrapper.plan(indptr, indices, last, num_pages=7)
    q = torch.randn(2, 32, 64, generator=gen).half()
    ref, _, _ = reference_over_pages(spec, q, k_pages, v_pages, indptr, indices, table.seq_lens, page_size, None)
    assert rel_l2(wrapper.run(q, k_pages, v_pages), ref) <= TOL


def test_kernel_option_is_checked():
    spec = foldc.AttentionSpec(4, 2, 64, foldc.Affine(2, "token", 64), foldc.Affine(2, "token", 64))
    with pytest.raises(foldc.SpecError, match="kernel='fast'"):
        PagedDecodeWrapper(spec, 32, max_seq_len=64, target="interpret", kernel="fast")
    with pytest.raises(foldc.SpecError, match="kernel='gluon' cannot run this paged decode: it runs on sm_90"):
        PagedDecodeWrapper(spec, 32, max_seq_len=64, target="interpret", kernel="gluon")
    assert PagedDecodeWrapper(spec, 32, max_seq_len=64, target="interpret").register_operand is False


def test_runs_of_one_plan_take_a_prepared_run_over_the_plans_buffers(monkeypatch):
    """The wrapper on the register-operand kernel (stand-in launches on the CPU): runs of one plan go through one
    prepared run per (query dtype, scale), bound from the second run, its decode given the plan's lengths and page
    table's addresses made once and each call's q; a re-plan into the same buffers keeps it; other pools (another
    layer's) get a prepared run of their own, and runs alternating between the layers keep both; a caller's lengths
    tensor (a paged cache's per-layer offsets) gets a prepared run over it, and a returned lse takes the plain run."""
    from _stand_in_wrapper import stand_in_register_operand

    from foldc.backends.gluon.decode_args import decode_addresses

    enc = A(2, "token", 128)
    spec = S(32, 8, 128, enc, enc)
    wrapper = PagedDecodeWrapper(spec, 64, max_seq_len=1024, device="cpu")
    decode, merge = stand_in_register_operand(wrapper, spec, monkeypatch)
    gen = torch.Generator().manual_seed(4)
    pools = [page_pool(spec, name, 20, 64) for name in "kv"]
    wrapper.plan(torch.tensor([0, 3, 5], dtype=torch.int32), torch.randperm(20, generator=gen)[:5].int(), None,
                 num_pages=20, seq_lens=[150, 100])
    q = torch.randn(2, 32, 128, generator=gen).half()
    out = torch.empty_like(q)
    for _ in range(4):
        q.normal_(generator=gen)
        wrapper.run(q, *pools, out=out, sm_scale=0.1)
    (prepared,) = wrapper._prepared.values()
    buf = wrapper._buffers
    table = (buf["kv_indptr"], buf["kv_indices"], 64)
    want = decode_addresses(q, *pools, buf["seq_lens"], buf["workspace_float16"], table)
    assert len(decode.launches) == 2 and decode.bound[0].calls == [want] * 2
    assert decode.bound[0].values == [(prepared.launch.cache_tokens,)] * 2
    wrapper.plan(torch.tensor([0, 10, 20], dtype=torch.int32), torch.randperm(20, generator=gen).int(), None,
                 num_pages=20, seq_lens=[600, 640])   # 20 entries fit the table's buffer (room for every page)
    wrapper.run(q, *pools, out=out, sm_scale=0.1)
    assert list(wrapper._prepared.values()) == [prepared] and len(decode.bound[0].calls) == 3
    others = [page_pool(spec, name, 20, 64) for name in "kv"]
    for _ in range(3):   # two layers' pools in turn: a prepared run each, both kept, bound launches by their addresses
        wrapper.run(q, *others, out=out, sm_scale=0.1)
        assert decode.bound[0].calls[-1][1] == others[0].codes.data_ptr()
        wrapper.run(q, *pools, out=out, sm_scale=0.1)
        assert decode.bound[0].calls[-1][1] == pools[0].codes.data_ptr()
    assert len(wrapper._prepared) == 2 and prepared in wrapper._prepared.values()
    assert len(decode.launches) == 2   # the other pools' first run: the same bound launches (same shapes)
    calls = len(decode.bound[0].calls)
    lens = torch.tensor([30, 40], dtype=torch.int32)
    for step in range(3):   # the caller's lengths, moved on in place: a prepared run over them, kept
        wrapper.run(q, *others, out=out, sm_scale=0.1, seq_lens=lens)
        assert decode.bound[0].calls[-1][7] == lens.data_ptr() and len(decode.bound[0].calls) == calls + step + 1
        lens += 1
    assert len(wrapper._prepared) == 3 and any(p.seq_lens is lens for p in wrapper._prepared.values())
    with pytest.raises(InputError, match="seq_lens must be an int32 tensor"):   # still checked at every call
        wrapper.run(q, *others, out=out, sm_scale=0.1, seq_lens=lens.long())
    _, lse = wrapper.run(q, *others, out=out, sm_scale=0.1, return_lse=True)
    assert lse is not wrapper._buffers["lse"]


def _repeating_wrapper(monkeypatch, plain_v: bool = False):
    """A wrapper on stand-in register-operand launches, planned over two sequences, with its pools, a query and an
    out: the pieces of a serving loop's repeated `run`."""
    from _stand_in_wrapper import stand_in_register_operand

    enc = A(2, "token", 128)
    spec = S(32, 8, 128, enc, None if plain_v else enc)
    wrapper = PagedDecodeWrapper(spec, 64, max_seq_len=1024, device="cpu")
    decode, _ = stand_in_register_operand(wrapper, spec, monkeypatch)
    gen = torch.Generator().manual_seed(23)
    pools = [page_pool(spec, "k", 20, 64), page_pool(spec, "v", 20, 64, dtype=torch.float16) if plain_v
             else page_pool(spec, "v", 20, 64)]
    wrapper.plan(torch.tensor([0, 3, 5], dtype=torch.int32), torch.randperm(20, generator=gen)[:5].int(), None,
                 num_pages=20, seq_lens=[150, 100])
    q = torch.randn(2, 32, 128, generator=gen).half()
    return wrapper, decode, pools, q, torch.empty_like(q), gen


def test_a_repeated_run_skips_its_checks_and_launches_with_the_new_query(monkeypatch):
    """A call that repeats the last checked one (same pools, lengths, scale and out; a q of the same shape, strides,
    dtype and device) goes straight to its prepared run: no check runs again, and the decode gets the new q's
    address. Another scale, other pools, another out, a q of another shape, a return_lse call or a plan in between
    each take the checks again."""
    wrapper, decode, pools, q, out, gen = _repeating_wrapper(monkeypatch)
    checks = []
    real = PagedDecodeWrapper._check_pool
    monkeypatch.setattr(PagedDecodeWrapper, "_check_pool", lambda self, *a: checks.append(a[0]) or real(self, *a))
    for _ in range(3):
        wrapper.run(q, *pools, out=out, sm_scale=0.1)
    assert wrapper._repeat is not None and len(checks) == 2   # the first call's pools; the others repeat it
    for _ in range(3):
        q2 = torch.randn(2, 32, 128, generator=gen).half()
        assert wrapper.run(q2, *pools, out=out, sm_scale=0.1) is out
        assert decode.bound[0].calls[-1][0] == q2.data_ptr()
    assert len(checks) == 2
    wrapper.run(q, *pools, out=out, sm_scale=0.2)                        # another scale: checked
    wrapper.run(q, *pools, out=torch.empty_like(q), sm_scale=0.2)        # another out: checked
    _, lse = wrapper.run(q, *pools, out=out, sm_scale=0.2, return_lse=True)   # lse asked: checked
    assert len(checks) == 8 and lse.shape == (2, 32)
    with pytest.raises(InputError, match="q shape"):
        wrapper.run(q[:1], *pools, out=out, sm_scale=0.2)
    wrapper.run(q, *pools, out=out, sm_scale=0.2)
    wrapper.plan(torch.tensor([0, 2, 5], dtype=torch.int32), torch.randperm(20, generator=gen)[:5].int(), None,
                 num_pages=20, seq_lens=[120, 190])
    assert wrapper._repeat is None
    before = len(checks)
    wrapper.run(q, *pools, out=out, sm_scale=0.2)
    assert len(checks) == before + 2
    other = [page_pool(wrapper.spec, name, 20, 64) for name in "kv"]
    wrapper.run(q, *other, out=out, sm_scale=0.2)
    assert len(checks) == before + 4


def test_a_repeated_run_still_refuses_a_query_over_its_out(monkeypatch):
    """The one check a repeated call keeps on its own: a q whose memory meets the out it writes is sent through the
    checks, which name it; a q of other strides or dtype is checked as any call."""
    wrapper, decode, pools, q, out, gen = _repeating_wrapper(monkeypatch)
    big = torch.randn(4, 32, 128, generator=gen).half()
    out = big[:2]
    for _ in range(2):
        wrapper.run(q, *pools, out=out, sm_scale=0.1)
    assert wrapper._repeat is not None
    with pytest.raises(InputError, match="out shares memory with q"):
        wrapper.run(big[1:3], *pools, out=out, sm_scale=0.1)
    with pytest.raises(InputError, match="q dtype"):
        wrapper.run(q.double(), *pools, out=out, sm_scale=0.1)
    strided = torch.randn(2, 128, 32, generator=gen).half().transpose(1, 2)
    with pytest.raises(InputError, match="unit stride"):
        wrapper.run(strided, *pools, out=out, sm_scale=0.1)


def test_a_repeated_run_keeps_refusing_gradients(monkeypatch):
    """A q or a plain pool that records gradients is not a repeat: the result is wrapped so that a backward through
    it raises, as for any call (a plain pool's requires_grad may be switched on in place between calls)."""
    wrapper, decode, pools, q, out, gen = _repeating_wrapper(monkeypatch, plain_v=True)
    for _ in range(2):
        wrapper.run(q, *pools, out=out, sm_scale=0.1)
    assert wrapper._repeat is not None
    pools[1].requires_grad_(True)
    result = wrapper.run(q, *pools, out=out, sm_scale=0.1)
    assert result.requires_grad
    with pytest.raises(foldc.FoldError, match="has no backward"):
        result.float().sum().backward()
    pools[1].requires_grad_(False)
    grad_q = q.clone().requires_grad_(True)
    assert wrapper.run(grad_q, *pools, out=out, sm_scale=0.1).requires_grad


def _shared_prefix_table(batch: int, num_pages: int, page_size: int, gen):
    """A table whose sequences all begin with the same 1..2 full pages (a prompt's prefix, read by each), then
    1..2 pages of their own, the last partly filled: the entries, and the lengths."""
    prefix = torch.randperm(num_pages, generator=gen)
    shared, own = prefix[:int(torch.randint(1, 3, (), generator=gen))], prefix[2:]
    rows, lens, taken = [], [], 0
    for _ in range(batch):
        mine = own[taken:taken + int(torch.randint(1, 3, (), generator=gen))]
        taken += mine.numel()
        rows.append(torch.cat([shared, mine]))
        lens.append((rows[-1].numel() - 1) * page_size + int(torch.randint(1, page_size + 1, (), generator=gen)))
    indptr = torch.tensor([0] + [r.numel() for r in rows]).cumsum(0).to(torch.int32)
    return indptr, torch.cat(rows).to(torch.int32), lens


@settings(max_examples=5, deadline=None)
@given(name=st.sampled_from(sorted(SPECS)), batch=st.integers(2, 3), seed=st.integers(0, 2**31 - 1))
def test_sequences_sharing_a_prefix_of_full_pages_read_it_each(name, batch, seed):
    """A prefix of full pages listed by every sequence (FlashInfer's shared prefix: one copy of a prompt's pages) is
    a table `plan` takes, and each sequence attends over it and its own pages within the bar of float64 over the
    same tokens gathered apart; the table's buffer holds room for it, so a re-plan does not move it."""
    spec, page_size = SPECS[name], 32
    gen = torch.Generator().manual_seed(seed)
    num_pages = 3 * batch + 2
    k_pages, v_pages = random_pools(spec, num_pages, page_size, gen)
    indptr, indices, lens = _shared_prefix_table(batch, num_pages, page_size, gen)
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=4 * page_size, target="interpret")
    table = wrapper.plan(indptr, indices, None, num_pages=num_pages, seq_lens=lens)
    assert list(table.seq_lens) == lens
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).half()
    got = wrapper.run(q, k_pages, v_pages, sm_scale=0.1)
    ref, k, v = reference_over_pages(spec, q, k_pages, v_pages, indptr, indices, lens, page_size, 0.1)
    assert rel_l2(got, ref) <= TOL
    buffer = wrapper.kv_indices
    every = torch.cat([indices[:int(indptr[1])]] * batch)   # every sequence the first one's pages: all shared
    wrapper.plan(torch.arange(0, every.numel() + 1, int(indptr[1]), dtype=torch.int32), every, None,
                 num_pages=num_pages, seq_lens=[int(indptr[1]) * page_size] * batch)
    assert wrapper.kv_indices is buffer


@pytest.mark.parametrize("entries, lens, where", [
    ([[5, 3], [3, 6]], [40, 64], "kv_indices\\[1\\] lists page 3 again, as entry 1 of sequence 0, which holds 40"),
    ([[5, 3], [3, 6]], [32, 64], "kv_indices\\[1\\] lists page 3 again, as entry 1 of sequence 0, which holds 32"),
    ([[3, 3], [6]], [40, 20], "kv_indices\\[1\\] lists page 3 again, as entry 1 of sequence 0, which holds 40"),
    ([[3, 5], [6, 3]], [64, 40], "kv_indices\\[3\\] lists page 3 again, as entry 1 of sequence 1, which holds 40"),
])
def test_a_page_listed_twice_is_refused_where_an_append_could_write_it(entries, lens, where):
    """A page listed more than once that is not full before each listing sequence's last token (its partly filled
    last page, or a page past its tokens reserved for appends) is refused, naming the entry; a PagedKVCache, whose
    appends write every page of its tables, refuses any page listed twice."""
    spec = S(4, 2, 64, A(2, "token", 32), A(2, "token", 32))
    wrapper = PagedDecodeWrapper(spec, 32, max_seq_len=128, target="interpret")
    indptr = torch.tensor([0] + [len(e) for e in entries]).cumsum(0).to(torch.int32)
    indices = torch.tensor([p for e in entries for p in e], dtype=torch.int32)
    with pytest.raises(InputError, match=where + " tokens: a page listed more than once must be full"):
        wrapper.plan(indptr, indices, None, num_pages=8, seq_lens=lens)
    from foldc.serving.page_table import check_page_table

    ok = torch.tensor([3, 5, 3, 6], dtype=torch.int32)
    assert check_page_table(indptr.new_tensor([0, 2, 4]), ok, None, 8, 32, [40, 64], shared=True).pages == (2, 2)
    with pytest.raises(InputError, match="lists page 3 more than once; every page-table entry of this cache"):
        check_page_table(indptr.new_tensor([0, 2, 4]), ok, None, 8, 32, [40, 64])


@pytest.mark.parametrize("target", ["interpret", "reference"])
def test_a_sparse_query_or_sparse_new_tokens_are_refused_by_name(target):
    """A sparse q was refused for its strides (0, 0, 0) ("pass a q of unit stride"), or raised RuntimeError from
    inside data_ptr beside an out; sparse tokens to `append_paged` raised from inside torch's copy. Each names the
    layout now; the pool is not written, and the dense calls match float64."""
    gen = torch.Generator().manual_seed(29)
    spec, page_size = SPECS["K token4 / V token2"], 16
    k_pages, v_pages = random_pools(spec, 6, page_size, gen)
    indptr, indices = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([4, 1, 5], dtype=torch.int32)
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=32, target=target)
    table = wrapper.plan(indptr, indices, torch.tensor([7, 16], dtype=torch.int32), num_pages=6)
    q = torch.randn(2, spec.num_q_heads, spec.head_dim, generator=gen).half()
    for out in (None, torch.empty(q.shape, dtype=torch.float32)):
        with pytest.raises(InputError, match=r"q is a tensor of layout torch\.sparse_coo; .* q\.to_dense\(\)"):
            wrapper.run(q.to_sparse(), k_pages, v_pages, out=out)
    ref, _, _ = reference_over_pages(spec, q, k_pages, v_pages, indptr, indices, table.seq_lens, page_size, None)
    assert rel_l2(wrapper.run(q, k_pages, v_pages), ref) <= TOL
    x = torch.randn(2, spec.num_kv_heads, 3, spec.head_dim, generator=gen).half()
    before = [t.clone() for t in (k_pages.codes, k_pages.scale, k_pages.zero)]
    with pytest.raises(InputError, match=r"x is a tensor of layout torch\.sparse_coo; .* x\.to_dense\(\)"):
        append_paged(k_pages, x.to_sparse(), indptr, indices, torch.tensor([23, 16], dtype=torch.int32),
                     page_size=page_size, target="reference" if target == "reference" else "auto")
    assert all(torch.equal(a, b) for a, b in zip(before, (k_pages.codes, k_pages.scale, k_pages.zero)))
