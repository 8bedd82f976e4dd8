"""Inputs that used to give a silently wrong answer (no error) in the serving layer, each now read
correctly or refused with a foldc error that names the value:

- strided views of the int tensors a kernel reads by index (``seq_lens`` of `PagedDecodeWrapper.run`,
  the page table, ``start`` and ``counts`` of `append_paged`, per-row offsets of `append_quantized`):
  the kernels read entry ``b`` at ``base + b``, so a column of a ``[batch, 2]`` tensor gave them
  other rows' values;
- `append_paged` into a pool whose codes, scales or zeros step by more than one element along their last
  dim (the kernel wrote each token's bytes at unit stride: in the wrong places);
- `append_paged` at negative positions (written into another page, or before the pool), and a
  channel-wise group off a group boundary (its rows ran past the page into the next one);
- non-integer ``seq_lens`` in `PagedDecodeWrapper.plan` (truncated to another length);
- lengths past a sequence's own pages under target="reference" (read padding copies of its last page);
- `gather_pages` of a page index of -1 (the pool's last page, read as the sequence's);
- `append_paged` with a decreasing ``kv_indptr`` (one sequence's tokens dropped, the next written over earlier
  sequences' pages).

Fresh random data throughout; Triton's interpreter (CPU, fp16) and the float64 reference.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.encoding import AffineTensor
from foldc.errors import InputError
from foldc.serving import PagedDecodeWrapper, append_paged, append_quantized, gather_pages, page_pool
from foldc.testing import rel_l2

A = foldc.Affine
S = foldc.AttentionSpec
SPEC = S(4, 2, 64, A(4, "token", 32), A(4, "channel", 16))
PAGE = 16


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a non-contiguous view (column 0 of a [n, 2] tensor whose column 1 differs)."""
    view = torch.stack([t, t.flip(0) + 7]).t().contiguous()[:, 0]
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


def random_table(gen, batch: int, num_pages: int):
    """Shuffled distinct pages, 1..3 per sequence."""
    per = torch.randint(1, 4, (batch,), generator=gen)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), per.cumsum(0)]).to(torch.int32)
    indices = torch.randperm(num_pages, generator=gen)[:int(per.sum())].to(torch.int32)
    return indptr, indices, per


def filled_pools(gen, num_pages: int):
    k = torch.randn(num_pages, SPEC.num_kv_heads, PAGE, SPEC.head_dim, generator=gen)
    v = torch.randn(num_pages, SPEC.num_kv_heads, PAGE, SPEC.head_dim, generator=gen) + 0.5
    return foldc.quantize(k, SPEC.k), foldc.quantize(v, SPEC.v)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_run_reads_a_strided_seq_lens_view_as_its_values(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, num_pages = 3, 12
    indptr, indices, per = random_table(gen, batch, num_pages)
    k_pages, v_pages = filled_pools(gen, num_pages)
    wrapper = PagedDecodeWrapper(SPEC, PAGE, max_seq_len=3 * PAGE, target="interpret")
    wrapper.plan(indptr, indices, None, num_pages=num_pages, seq_lens=[1] * batch)
    lens = (1 + (torch.rand(batch, generator=gen) * (per * PAGE - 1)).long()).to(torch.int32)
    q = torch.randn(batch, 4, 64, generator=gen).half()
    got = wrapper.run(q, k_pages, v_pages, seq_lens=strided(lens))
    want = wrapper.run(q, k_pages, v_pages, seq_lens=lens.clone())
    assert torch.equal(got, want)
    k, _ = gather_pages(k_pages, indptr, indices, lens.tolist(), PAGE)
    v, _ = gather_pages(v_pages, indptr, indices, lens.tolist(), PAGE)
    ref = foldc.compile(SPEC, "reference")(q, k, v, seq_lens=lens)
    assert rel_l2(got, ref) < 2e-3


@settings(max_examples=8, deadline=None)
@given(which=st.sampled_from(["kv_indptr", "kv_indices", "start", "counts"]),
       layout=st.sampled_from(["token", "channel"]), seed=st.integers(0, 2**31 - 1))
def test_append_paged_reads_strided_page_tables_as_their_values(which, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    enc = A(4, layout, 16)
    batch, num_pages, tokens = 3, 12, 16
    indptr, indices, per = random_table(gen, batch, num_pages)
    unit = 16 if layout == "channel" else 1
    args = {"kv_indptr": indptr, "kv_indices": indices,
            "start": (torch.randint(0, PAGE, (batch,), generator=gen) // unit * unit).to(torch.int32),
            "counts": (torch.randint(unit, tokens + 1, (batch,), generator=gen) // unit * unit).to(torch.int32)}
    x = (torch.randn(batch, 2, tokens, 64, generator=gen) * 2 + 1).half()
    pools = [page_pool(S(4, 2, 64, enc, enc), "k", num_pages, PAGE) for _ in range(2)]
    for pool, view in zip(pools, (False, True)):
        call = dict(args, **{which: strided(args[which])}) if view else args
        append_paged(pool, x, call["kv_indptr"], call["kv_indices"], call["start"], page_size=PAGE,
                     counts=call["counts"], target="interpret")
    assert (pools[0].scale != 0).any(-1).sum() >= batch * 2   # every sequence wrote
    for part in ("codes", "scale", "zero"):
        assert torch.equal(getattr(pools[1], part), getattr(pools[0], part)), part


@pytest.mark.parametrize("check", [True, False])
def test_append_quantized_reads_strided_offsets_as_their_values(check):
    gen = torch.Generator().manual_seed(3)
    enc = A(4, "token", 32)
    dst = [foldc.quantize(torch.zeros(3, 2, 48, 64), enc) for _ in range(2)]
    x = torch.randn(3, 2, 8, 64, generator=gen).half()
    offsets = torch.tensor([0, 24, 40])
    append_quantized(dst[0], x, offsets, target="interpret", check=check)
    append_quantized(dst[1], x, strided(offsets), target="interpret", check=check)
    for part in ("codes", "scale", "zero"):
        assert torch.equal(getattr(dst[1], part), getattr(dst[0], part)), part


@pytest.mark.parametrize("target", ["interpret", "reference"])
def test_append_paged_never_writes_at_negative_positions(target):
    """Sequence 0 starts 5 tokens before its first page: those tokens have no page and are not written
    (they used to land at negative rows, i.e. in the page before it in memory, or wrap to its last page
    under the reference); the rest land where quantize puts them."""
    gen = torch.Generator().manual_seed(5)
    enc = A(4, "token", 32)
    pool = page_pool(S(4, 2, 64, enc, enc), "k", 6, PAGE)
    x = torch.randn(1, 2, 21, 64, generator=gen).half()   # positions -5..15
    append_paged(pool, x, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32),
                 torch.tensor([-5], dtype=torch.int32), page_size=PAGE, target=target)
    written = (pool.scale != 0).any(-1)   # [pages, heads, rows]
    assert not written[[0, 2, 4, 5]].any()
    assert written[3].all() and not written[1].any()
    want = foldc.quantize(x[:, :, 5:], enc)   # token-wise: each token quantized on its own
    assert torch.equal(pool.codes[3], want.codes[0, :, :16]) and torch.equal(pool.scale[3], want.scale[0, :, :16])


def test_append_paged_skips_a_channel_group_off_a_group_boundary():
    """A channel-wise group starting mid-group (start 8, groups of 16) would fill rows 8..23 of a
    16-row page, i.e. 8 rows of the next page in memory, which the sequence does not own."""
    enc = A(4, "channel", 16)
    pool = page_pool(S(4, 2, 64, enc, enc), "k", 4, PAGE)
    x = torch.randn(1, 2, 16, 64, generator=torch.Generator().manual_seed(6)).half()
    table = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
             torch.tensor([8], dtype=torch.int32))
    append_paged(pool, x, *table, page_size=PAGE, target="interpret")
    assert not pool.codes.any() and not pool.scale.any()
    with pytest.raises(InputError, match=r"start\[0\]=8 is not a multiple of group_size=16"):
        append_paged(pool, x, *table, page_size=PAGE, target="reference")


def every_other_column(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s shape with stride 2 along its last dim (every other column of a twice-as-wide tensor)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    return wide[..., ::2]


@settings(max_examples=6, deadline=None)
@given(layout=st.sampled_from(["token", "channel"]), part=st.sampled_from(["codes", "scale", "zero"]),
       seed=st.integers(0, 2**31 - 1))
def test_append_paged_refuses_a_pool_without_unit_stride_along_its_last_dim(layout, part, seed):
    """The kernel writes a token's bytes at unit stride: into every other column of a wider tensor it put
    them in the wrong places (codes no longer those of quantize), silently. A pool sliced along pages or
    tokens (unit last stride) is written as quantize computes."""
    gen = torch.Generator().manual_seed(seed)
    enc = A(4, layout, 16)
    x = torch.randn(1, 2, 16, 64, generator=gen).half()
    table = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
             torch.zeros(1, dtype=torch.int32))
    pool = page_pool(S(4, 2, 64, enc, enc), "k", 4, PAGE)
    strided_pool = AffineTensor(*(every_other_column(getattr(pool, p)) if p == part else getattr(pool, p)
                                  for p in ("codes", "scale", "zero")), enc, 64)
    with pytest.raises(InputError, match=rf"pool.{part} must have unit stride along its last dim"):
        append_paged(strided_pool, x, *table, page_size=PAGE, target="interpret")
    assert not getattr(strided_pool, part).any()
    sliced = page_pool(S(4, 2, 64, enc, enc), "k", 8, PAGE)
    sliced = AffineTensor(sliced.codes[::2], sliced.scale[::2], sliced.zero[::2], enc, 64)
    append_paged(sliced, x, *table, page_size=PAGE, target="interpret")
    want = foldc.quantize(x, enc)
    for p in ("codes", "scale", "zero"):
        assert torch.equal(getattr(sliced, p)[2], getattr(want, p)[0]), p


def test_append_paged_refuses_a_page_table_that_is_not_an_int_tensor():
    enc = A(4, "token", 32)
    pool = page_pool(S(4, 2, 64, enc, enc), "k", 4, PAGE)
    x = torch.randn(1, 2, 4, 64).half()
    indptr, start = torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for bad in ([2], torch.tensor([2.0]), torch.tensor([[2]], dtype=torch.int32)):
        with pytest.raises(InputError, match=r"kv_indices must be an int32 tensor"):
            append_paged(pool, x, indptr, bad, start, page_size=PAGE, target="interpret")


def test_plan_refuses_non_integer_seq_lens():
    wrapper = PagedDecodeWrapper(SPEC, PAGE, max_seq_len=64, target="interpret")
    table = (torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([3, 0, 1, 2], dtype=torch.int32), None)
    for bad in ([20.7, 17.0], torch.tensor([20.5, 3.0])):
        with pytest.raises(InputError, match=r"seq_lens dtype=torch.float(32|64).*integer token count"):
            wrapper.plan(*table, num_pages=4, seq_lens=bad)
    with pytest.raises(InputError, match=r"seq_lens has 3 entries but kv_indptr describes batch=2"):
        wrapper.plan(*table, num_pages=4, seq_lens=[1, 2, 3])
    assert wrapper.plan(*table, num_pages=4, seq_lens=torch.tensor([20, 17])).seq_lens == (20, 17)


@settings(max_examples=8, deadline=None)
@given(bad=st.sampled_from(["negative page", "page past the pool", "length past its pages", "other page size"]),
       seed=st.integers(0, 2**31 - 1))
def test_gather_pages_refuses_a_table_the_wrapper_refuses(bad, seed):
    """gather_pages took its table unchecked: a page index of -1 read the pool's last page (a wrong cache, silently),
    one past the pool raised an IndexError from inside torch, and lengths past a sequence's pages or a page size
    other than the pool's came back as given. Each is refused now, as PagedDecodeWrapper.plan refuses it; a good
    table gathers each sequence's pages in order."""
    gen = torch.Generator().manual_seed(seed)
    batch, num_pages = 3, 12
    indptr, indices, per = random_table(gen, batch, num_pages)
    lens = [int(n) for n in (1 + (torch.rand(batch, generator=gen) * (per * PAGE - 1)).long())]
    k_pages, _ = filled_pools(gen, num_pages)
    k, got = gather_pages(k_pages, indptr, indices, lens, PAGE)
    first = indices[int(indptr[1]) - 1]   # sequence 0's last page
    assert got.tolist() == lens and torch.equal(k.codes[0, :, (int(per[0]) - 1) * PAGE:int(per[0]) * PAGE],
                                                k_pages.codes[first])
    table, page_size = [indptr, indices.clone(), lens], PAGE
    at = int(torch.randint(0, indices.numel(), (1,), generator=gen))
    if bad == "negative page":
        table[1][at] = -1
        match = rf"kv_indices\[{at}\]=-1 points outside the pool of num_pages={num_pages}"
    elif bad == "page past the pool":
        table[1][at] = num_pages
        match = rf"kv_indices\[{at}\]={num_pages} points outside the pool"
    elif bad == "length past its pages":
        table[2] = [lens[0], int(per[1]) * PAGE + 1, lens[2]]
        match = rf"seq_lens\[1\]={int(per[1]) * PAGE + 1} but sequence 1 owns {int(per[1])} pages"
    else:
        page_size = PAGE // 2
        match = rf"pool holds pages of {PAGE} tokens but page_size={PAGE // 2}"
    with pytest.raises(InputError, match=match):
        gather_pages(k_pages, *table, page_size)


def test_reference_run_refuses_lengths_past_its_own_pages():
    """The reference gathers each sequence padded with copies of its last page: a device length past
    its pages (or past max_seq_len) read those copies, where the kernels read only its own tokens."""
    gen = torch.Generator().manual_seed(8)
    k_pages, v_pages = filled_pools(gen, 6)
    table = (torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([5, 0, 2, 4], dtype=torch.int32), None)
    q = torch.randn(2, 4, 64, generator=gen).half()
    wrapper = PagedDecodeWrapper(SPEC, PAGE, max_seq_len=40, target="reference")
    wrapper.plan(*table, num_pages=6, seq_lens=[10, 33])
    for lens, match in (([20, 33], r"seq_lens\[0\]=20 but sequence 0 owns 1 pages"),
                        ([10, 45], r"seq_lens\[1\]=45 .*max_seq_len=40"),
                        ([10, -1], r"needs every sequence to hold a token")):
        with pytest.raises(InputError, match=match):
            wrapper.run(q, k_pages, v_pages, seq_lens=torch.tensor(lens, dtype=torch.int32))
    kernel = PagedDecodeWrapper(SPEC, PAGE, max_seq_len=40, target="interpret")
    kernel.plan(*table, num_pages=6, seq_lens=[10, 33])
    lens = torch.tensor([16, 40], dtype=torch.int32)   # within both: the reference and the kernel agree
    assert rel_l2(kernel.run(q, k_pages, v_pages, seq_lens=lens),
                  wrapper.run(q, k_pages, v_pages, seq_lens=strided(lens))) < 2e-3


def _unreadable(t: torch.Tensor, kind: str) -> torch.Tensor:
    return t.to("meta") if kind == "meta" else t.to_sparse()


@pytest.mark.parametrize("kind", ["meta", "sparse"])
@pytest.mark.parametrize("entry, arg", [
    ("plan", "kv_indptr"), ("plan", "kv_indices"), ("plan", "kv_last_page_len"), ("plan", "seq_lens"),
    ("gather_pages", "kv_indptr"), ("gather_pages", "kv_indices"), ("gather_pages", "seq_lens"),
    ("PagedKVCache.plan", "kv_indptr"), ("PagedKVCache.plan", "seq_lens"),
    ("append_paged", "kv_indptr"), ("append_paged", "kv_indices"), ("append_paged", "start"),
    ("append_paged", "counts")])
def test_page_tables_and_lengths_with_no_values_to_read_are_refused_by_name(entry, arg, kind):
    """A page table or lengths on the meta device or sparse raised NotImplementedError ("Cannot copy out of meta
    tensor") or RuntimeError ("Cannot access data pointer", "unsupported memory format") from inside torch, naming
    no argument; each is an InputError naming the argument now. The same values as dense tensors are taken."""
    from foldc.serving import PagedKVCache

    gen = torch.Generator().manual_seed(9)
    k_pages, _ = filled_pools(gen, 4)
    table = {"kv_indptr": torch.tensor([0, 2, 3], dtype=torch.int32),
             "kv_indices": torch.tensor([3, 0, 1], dtype=torch.int32),
             "kv_last_page_len": torch.tensor([5, 7], dtype=torch.int32), "seq_lens": torch.tensor([21, 7]),
             "start": torch.zeros(2, dtype=torch.int32), "counts": torch.full((2,), 16, dtype=torch.int32)}

    def call(args: dict):
        if entry == "plan":
            last = None if arg == "seq_lens" else args["kv_last_page_len"]
            seq = args["seq_lens"] if arg == "seq_lens" else None
            PagedDecodeWrapper(SPEC, PAGE, max_seq_len=64, target="reference").plan(
                args["kv_indptr"], args["kv_indices"], last, num_pages=4, seq_lens=seq)
        elif entry == "gather_pages":
            gather_pages(k_pages, args["kv_indptr"], args["kv_indices"], args["seq_lens"], PAGE)
        elif entry == "PagedKVCache.plan":
            cache = PagedKVCache(SPEC, num_layers=1, page_size=PAGE, num_pages=4, max_seq_len=64, target="reference")
            cache.plan(args["kv_indptr"], args["kv_indices"], args["seq_lens"] * 0)
        else:
            pool = page_pool(SPEC, "v", 4, PAGE)
            x = torch.randn(2, 2, 16, 64, generator=gen).half()
            append_paged(pool, x, args["kv_indptr"], args["kv_indices"], args["start"], page_size=PAGE,
                         counts=args["counts"], target="interpret")

    call(table)
    bad = dict(table, **{arg: _unreadable(table[arg], kind)})
    where = "on the meta device" if kind == "meta" else "of layout torch.sparse_coo"
    match = rf"{arg} is a tensor {where}" if kind == "sparse" or entry != "append_paged" else rf"{arg} is on meta"
    with pytest.raises(InputError, match=match):
        call(bad)


@pytest.mark.parametrize("target", ["interpret", "reference"])
@pytest.mark.parametrize("bad", ["past the end", "negative"])
def test_append_paged_refuses_a_kv_indptr_past_its_kv_indices(bad, target):
    """kv_indptr [0, 3] over a kv_indices of one entry (a view of a longer table): the kernel read entries 1 and 2
    past kv_indices' end, the next table's page numbers, and wrote 24 of the 40 tokens into those pages (another
    sequence's, silently); the reference dropped them. Refused now, nothing written; a kv_indices longer than
    kv_indptr[-1] (the wrapper's buffer of num_pages entries) is taken."""
    gen = torch.Generator().manual_seed(10)
    enc = A(4, "token", 32)
    pool = page_pool(S(4, 2, 64, enc, enc), "k", 8, PAGE)
    x = torch.randn(1, 2, 40, 64, generator=gen).half()
    table = torch.tensor([5, 6, 7, 1, 2, 3], dtype=torch.int32)
    indptr = torch.tensor([0, 3] if bad == "past the end" else [-2, 3], dtype=torch.int32)
    start = torch.zeros(1, dtype=torch.int32)
    match = (r"kv_indptr\[1\]=3 but kv_indices holds 1 entries" if bad == "past the end"
             else r"kv_indptr\[0\]=-2 but kv_indices holds 1 entries")
    with pytest.raises(InputError, match=match + r".*pass the kv_indices this kv_indptr indexes"):
        append_paged(pool, x, indptr, table[:1], start, page_size=PAGE, target=target)
    assert not pool.codes.any() and not pool.scale.any()   # nothing written
    append_paged(pool, x, torch.tensor([0, 3], dtype=torch.int32), table, start, page_size=PAGE, target=target)
    k, _ = gather_pages(pool, torch.tensor([0, 3], dtype=torch.int32), table[:3], [40], PAGE)
    want = foldc.quantize(x, enc)
    assert torch.equal(k.codes[:, :, :40], want.codes) and torch.equal(k.scale[:, :, :40], want.scale)


@pytest.mark.parametrize("target", ["interpret", "reference"])
@pytest.mark.parametrize("layout", ["token", "channel"])
def test_append_paged_refuses_a_kv_indptr_that_decreases(layout, target):
    """kv_indptr [0, 3, 1, 4] (a prefix sum gone wrong): sequence 1 owned no entry, its tokens dropped, and sequence
    2 entries 1..3, two of them sequence 0's, so its tokens were written over sequence 0's through the same entries
    (which the check of a page written through two entries does not see), silently. Refused now on a table read
    with no device sync (CPU, "reference"), nothing written; the table put right writes every sequence's tokens."""
    gen = torch.Generator().manual_seed(11 if layout == "token" else 12)
    enc = A(4, layout, 32 if layout == "token" else 16)
    pool = page_pool(S(4, 2, 64, enc, enc), "k", 8, PAGE)
    x = torch.randn(3, 2, 32, 64, generator=gen).half()
    table = torch.randperm(8, generator=gen)[:6].to(torch.int32)
    start = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(InputError, match=r"kv_indptr decreases at sequence 1 \(3 -> 1\); it must be non-decreasing"):
        append_paged(pool, x, torch.tensor([0, 3, 1, 4], dtype=torch.int32), table, start, page_size=PAGE,
                     target=target)
    assert not pool.codes.any() and not pool.scale.any()   # nothing written
    indptr = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    append_paged(pool, x, indptr, table, start, page_size=PAGE, target=target)
    k, _ = gather_pages(pool, indptr, table, [32] * 3, PAGE)
    want = foldc.quantize(x, enc)
    assert torch.equal(k.codes, want.codes) and torch.equal(k.scale, want.scale) and torch.equal(k.zero, want.zero)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), layout=st.sampled_from(["token", "channel"]))
def test_append_kernels_never_read_page_table_entries_past_kv_indices(seed, layout):
    """On the GPU `append_paged` cannot check kv_indptr against kv_indices' length without a device sync, so the
    kernels bound it themselves: a token whose table entry kv_indptr puts at or past ``len(kv_indices)`` is not
    written (before, the kernels read the memory after the table as page numbers). The host check is skipped here
    (``table_checked``, as for a GPU table); kv_indices is the head of a longer table whose tail names other pages.
    The pool afterwards equals the reference's with kv_indptr clipped to the table's length."""
    from foldc.serving.append import write_paged

    gen = torch.Generator().manual_seed(seed)
    enc = A(4, layout, 32 if layout == "token" else 16)
    pages = 10
    full = torch.randperm(pages, generator=gen).to(torch.int32)   # the memory after kv_indices: real page numbers
    entries = int(torch.randint(1, 4, (1,), generator=gen))
    over = int(torch.randint(1, 4, (1,), generator=gen))
    indptr = torch.tensor([0, entries - 1, entries + over], dtype=torch.int32)   # sequence 1 runs past the table
    x = torch.randn(2, 2, 64, 64, generator=gen).half()
    start = torch.zeros(2, dtype=torch.int32)
    pools = []
    for how in ("kernel", "reference"):
        pool = page_pool(S(4, 2, 64, enc, enc), "k", pages, PAGE)
        for part in (pool.codes, pool.scale, pool.zero):   # fresh random contents: a write shows
            part.copy_(torch.randint(0, 200, part.shape, generator=torch.Generator().manual_seed(seed)))
        if how == "kernel":
            write_paged(pool, x, indptr, full[:entries], start, page_size=PAGE, target="interpret",
                        table_checked=True)
        else:
            append_paged(pool, x, indptr.clamp(max=entries), full[:entries], start, page_size=PAGE,
                         target="reference")
        pools.append(pool)
    kernel, reference = pools
    before = torch.randint(0, 200, kernel.codes.shape, generator=torch.Generator().manual_seed(seed))
    assert not torch.equal(kernel.codes, before.to(kernel.codes.dtype))   # sequence 1's first page was written
    for name in ("codes", "scale", "zero"):
        assert torch.equal(getattr(kernel, name), getattr(reference, name)), name


@settings(max_examples=8, deadline=None)
@given(layout=st.sampled_from(["token", "channel"]), target=st.sampled_from(["interpret", "reference"]),
       same_sequence=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_append_paged_refuses_a_page_it_would_write_through_two_entries(layout, target, same_sequence, seed):
    """A page table whose entries name one page twice (two sequences', or one sequence's page listed twice), called
    without `PagedDecodeWrapper.plan` (which refuses such a table where appends could write it): `append_paged` wrote both entries' tokens into
    that page, the last write winning, so one sequence's tokens were another's, silently. Refused now by name,
    nothing written. A shared page that no token of the append lands on (a prefix's page, tokens written past it)
    still passes, and the append writes what it writes over a table of distinct pages."""
    gen = torch.Generator().manual_seed(seed)
    enc = A(4, layout, 32 if layout == "token" else 16)
    spec, pages = S(4, 2, 64, enc, enc), 8

    def pool():
        p = page_pool(spec, "k", pages, PAGE)
        for part in (p.codes, p.scale, p.zero):   # fresh random contents: a write shows
            part.copy_(torch.randint(0, 200, part.shape, generator=torch.Generator().manual_seed(seed)))
        return p

    order = torch.randperm(pages, generator=gen).to(torch.int32)
    indptr = torch.tensor([0, 2, 4], dtype=torch.int32)
    x = torch.randn(2, 2, 2 * PAGE, 64, generator=gen).half()   # both pages of each sequence
    table = order[:4].clone()
    table[1 if same_sequence else 2] = table[0]
    p = pool()
    with pytest.raises(InputError, match=rf"kv_indices\[0\] and kv_indices\[{1 if same_sequence else 2}\] both name "
                                         rf"page {int(table[0])}.*of its own"):
        append_paged(p, x, indptr, table, torch.zeros(2, dtype=torch.int32), page_size=PAGE, target=target)
    assert all(torch.equal(getattr(p, f), getattr(pool(), f)) for f in ("codes", "scale", "zero"))
    # sequence 1's first page is sequence 0's (a shared prefix): tokens from position PAGE on land on neither
    shared, own = order[:4].clone(), order[:4].clone()
    shared[2] = shared[0]
    got, want = pool(), pool()
    start = torch.full((2,), PAGE, dtype=torch.int32)
    append_paged(got, x[:, :, :PAGE], indptr, shared, start, page_size=PAGE, target=target)
    append_paged(want, x[:, :, :PAGE], indptr, own, start, page_size=PAGE, target=target)
    assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("codes", "scale", "zero"))
    assert not torch.equal(got.codes, pool().codes)   # it wrote
