"""The shared validation layer (foldc/validate.py): every public entry point refuses the same bad
scale factors, output buffers and merge parts with the same FoldError, and NaN from the data
propagates as NaN instead of turning into zeros."""
from __future__ import annotations

import dataclasses
import math
import re
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
import foldc.serving.paged as paged_module
from foldc.errors import InputError, InputTypeError
from foldc.serving import PagedDecodeWrapper, PagedKVCache, QuantizedKVCache, gather_pages, page_pool
from foldc.testing import rel_l2
from foldc.validate import check_no_overlap, check_out, check_sm_scale

A = foldc.Affine
SPEC = foldc.AttentionSpec(4, 2, 64, k=A(2, "token", 32), v=A(4, "channel", 16))
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered in log2:RuntimeWarning")

BAD_SCALES = [(float("nan"), InputError, "sm_scale=nan must be finite"),
              (float("inf"), InputError, "sm_scale=inf must be finite"),
              (-math.inf, InputError, "sm_scale=-inf must be finite"),
              ("0.1", InputTypeError, "sm_scale='0.1' must be a real number"),
              (b"1", InputTypeError, "sm_scale=b'1' must be a real number"),
              (True, InputTypeError, "sm_scale=True must be a real number"),
              ([0.1], InputTypeError, r"sm_scale=\[0.1\] must be a real number"),
              (1 + 2j, InputTypeError, r"sm_scale=\(1\+2j\) must be a real number")]


def _inputs(gen, batch=1, tokens=32, spec=SPEC):
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).half()
    k = foldc.quantize(torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen), spec.k)
    v = foldc.quantize(torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen), spec.v)
    return q, k, v


@pytest.mark.parametrize("value, exc, match", BAD_SCALES)
def test_check_sm_scale_refuses_what_is_not_a_finite_real(value, exc, match):
    with pytest.raises(exc, match=match):
        check_sm_scale(value, 64)


@pytest.mark.parametrize("value", [0.1, 1, torch.tensor(0.3), 2.5e-3])
def test_check_sm_scale_takes_reals(value):
    assert check_sm_scale(value, 64) == pytest.approx(float(value))
    assert check_sm_scale(None, 64) == 0.125


@pytest.mark.parametrize("target", ["reference", "interpret"])
def test_an_sm_scale_that_records_gradients_is_refused_not_read_as_a_number(target):
    """A tensor sm_scale that records gradients was read with .item(): its gradient dropped on every target, the
    reference's included, silently. Refused with the fix now; detached, or under no_grad, it is the number it holds."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    q, k, v = _inputs(gen)
    attn = foldc.compile(SPEC, target=target)
    scale = (0.05 + torch.rand((), generator=gen)).requires_grad_()
    with pytest.raises(InputError, match=r"sm_scale is a tensor that records gradients.*sm_scale\.detach\(\)"):
        attn(q, k, v, sm_scale=scale)
    with pytest.raises(InputError, match="sm_scale is a tensor that records gradients"):
        check_sm_scale(scale, 64)
    want = attn(q, k, v, sm_scale=float(scale.detach()))
    assert torch.equal(attn(q, k, v, sm_scale=scale.detach()), want)
    with torch.no_grad():
        assert torch.equal(attn(q, k, v, sm_scale=scale), want)


def _paged_cache(target):
    cache = PagedKVCache(SPEC, num_layers=1, page_size=16, num_pages=8, max_seq_len=64, sink=2, window=4,
                         target=target)
    cache.plan(torch.tensor([0, 4], dtype=torch.int32), torch.arange(4, dtype=torch.int32), [0])
    gen = torch.Generator().manual_seed(1)
    cache.append(0, torch.randn(1, 2, 36, 64, generator=gen).half(), torch.randn(1, 2, 36, 64, generator=gen).half())
    return cache


def _wrapper():
    w = PagedDecodeWrapper(SPEC, 16, max_seq_len=64, target="interpret")
    w.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32), None, num_pages=4,
           seq_lens=[20])
    return w


@pytest.mark.parametrize("entry", ["reference", "interpret", "paged-cache", "paged-cache-reference", "wrapper",
                                   "contiguous-cache", "attention_reference", "torch-op"])
@pytest.mark.parametrize("value, exc, match", BAD_SCALES[:4])
def test_every_entry_point_refuses_a_bad_sm_scale(entry, value, exc, match):
    gen = torch.Generator().manual_seed(0)
    q, k, v = _inputs(gen)
    if entry in ("reference", "interpret"):
        call = lambda: foldc.compile(SPEC, target=entry)(q, k, v, sm_scale=value)  # noqa: E731
    elif entry.startswith("paged-cache"):
        cache = _paged_cache("reference" if entry.endswith("reference") else "interpret")
        call = lambda: cache.attention(0, q, sm_scale=value)  # noqa: E731
    elif entry == "wrapper":
        w = _wrapper()
        call = lambda: w.run(q, page_pool(SPEC, "k", 4, 16), page_pool(SPEC, "v", 4, 16), sm_scale=value)  # noqa
    elif entry == "contiguous-cache":
        cache = QuantizedKVCache(SPEC, 1, 64, window=4, target="interpret")
        cache.append(torch.randn(1, 2, 20, 64, generator=gen).half(), torch.randn(1, 2, 20, 64, generator=gen).half())
        call = lambda: cache.attention(q, sm_scale=value)  # noqa: E731
    elif entry == "attention_reference":
        call = lambda: foldc.attention_reference(q, k, v, sm_scale=value)  # noqa: E731
    else:
        from foldc.ops import attention_op
        call = lambda: attention_op(SPEC, q, k, v, sm_scale=value)  # noqa: E731
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("target", ["reference", "interpret"])
@pytest.mark.parametrize("out, exc, match", [
    (torch.empty(1, 4, 64, dtype=torch.int32), InputError, "out dtype=torch.int32 cannot hold the result"),
    (torch.empty(1, 4, 64, dtype=torch.bool), InputError, "out dtype=torch.bool cannot hold the result"),
    ([1], InputTypeError, "out must be a torch.Tensor"),
    (torch.empty(1, 4, 32), InputError, r"out shape=\(1, 4, 32\) but the result is \(1, 4, 64\)"),
    (torch.empty(1, 64, 4).transpose(1, 2), InputError, "needs unit stride along its last axis"),
    (torch.empty(1, 4, 64).expand(3, 4, 64), InputError, r"some of its elements share memory"),
    (torch.empty(1, 4, 64, device="meta"), InputError, "out is on meta but the result is computed on cpu"),
])
def test_a_bad_out_is_refused_before_anything_is_written(target, out, exc, match):
    q, k, v = _inputs(torch.Generator().manual_seed(2))
    if isinstance(out, torch.Tensor) and out.shape[0] == 3:   # the expanded out: three queries
        q = torch.cat([q] * 3)
        k, v = (foldc.quantize(torch.randn(3, *t.shape[1:]), t.encoding) for t in (k, v))
    with pytest.raises(exc, match=match):
        foldc.compile(SPEC, target=target)(q, k, v, out=out)


def test_out_is_written_in_place_when_it_is_good():
    q, k, v = _inputs(torch.Generator().manual_seed(3))
    want = foldc.attention_reference(q, k, v)
    for dtype in (torch.float64, torch.float32):
        out = torch.full((1, 4, 64), 7.0, dtype=dtype)
        got = foldc.compile(SPEC, target="reference")(q, k, v, out=out)
        assert got is out and torch.allclose(out.double(), want, rtol=1e-6, atol=1e-6)
    assert check_out(None, (1,), torch.device("cpu"), (torch.float32,)) is None


def test_the_wrapper_refuses_an_integer_out():
    q, _, _ = _inputs(torch.Generator().manual_seed(4))
    with pytest.raises(InputError, match="out dtype=torch.int64 cannot hold the result"):
        _wrapper().run(q, page_pool(SPEC, "k", 4, 16), page_pool(SPEC, "v", 4, 16),
                       out=torch.empty(1, 4, 64, dtype=torch.int64))


@pytest.mark.parametrize("entry", ["reference", "interpret", "wrapper-reference", "wrapper-interpret"])
@pytest.mark.parametrize("make, exc, match", [
    (lambda: [0.5] * 4, InputTypeError, r"out must be a torch\.Tensor \(1, 4, 64\) or None, got list"),
    (lambda: torch.rand(1, 4, 64).half().numpy(), InputTypeError, "out must be a torch.Tensor .* got ndarray"),
    (lambda: (torch.rand(1, 4, 64) + 0.5).half().to_sparse(), InputError,
     "out is a tensor of layout torch.sparse_coo"),
    (lambda: (torch.rand(4, 64) + 0.5).half().to_sparse_csr(), InputError,
     "out is a tensor of layout torch.sparse_csr"),
], ids=["list", "ndarray", "sparse-coo", "sparse-csr"])
def test_an_out_that_is_not_a_dense_tensor_is_refused_by_name(entry, make, exc, match):
    """An out that is not a tensor (a list, a NumPy array) reached the paged wrapper's overlap check, which read its
    address (AttributeError: no data_ptr); a sparse out raised torch's RuntimeError from inside data_ptr on every
    target. Each is refused by name, and the same call with a dense out matches the float64 reference."""
    inputs, call = _attention_call(entry, SPEC, torch.Generator().manual_seed(31))
    args = [inputs["q"], *(v for n, v in inputs.items() if n != "q")]
    with pytest.raises(exc, match=match):
        call(*args, out=make())
    want = foldc.compile(SPEC, target="reference")
    if entry.startswith("wrapper"):
        k, v = (gather_pages(inputs[f"{n}_pages"], torch.tensor([0, 2], dtype=torch.int32),
                                           torch.tensor([1, 0], dtype=torch.int32), [20], 16)[0] for n in "kv")
        want = want(inputs["q"], k, v, seq_lens=torch.tensor([20]))
    else:
        want = want(*args)
    got = call(*args, out=torch.full((1, 4, 64), float("nan"), dtype=torch.float32))
    assert rel_l2(got, want) < 1e-3


# ---- merge_attention --------------------------------------------------------------------------

def _parts(gen, n=2):
    return [(torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("bad, exc, match", [
    (lambda p: [p[0][0]], InputTypeError, r"part 0 must be a pair \(out, lse\)"),
    (lambda p: p[0][0], InputTypeError, "parts must be a list of"),
    (lambda p: [], InputError, "at least one"),
    (lambda p: [(p[0][0], [1.0])], InputTypeError, "part 0: lse must be a torch.Tensor"),
    (lambda p: [(p[0][0].long(), p[0][1])], InputError, "part 0: out dtype=torch.int64 must be floating point"),
    (lambda p: [p[0], (p[1][0][:1], p[1][1][:1])], InputError, r"part 1: out \(1, 4, 8\) .* does not match"),
    (lambda p: [(p[0][0], p[0][1][:, :2])], InputError, r"and lse out.shape\[:2\]"),
    (lambda p: [(p[0][0], p[0][1].index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(math.nan))),
                p[1]], InputError, r"part 0: lse=nan at \[batch, head\] \[1, 2\] but its output there is finite"),
    (lambda p: [(p[0][0], p[0][1].index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(math.inf)))],
     InputError, r"part 0: lse=inf at \[batch, head\] \[0, 0\]"),
])
def test_merge_refuses_parts_that_did_not_come_from_attention(bad, exc, match):
    with pytest.raises(exc, match=match):
        foldc.merge_attention(bad(_parts(torch.Generator().manual_seed(5))))


def test_merge_propagates_nan_from_the_data():
    """A part whose keys held NaN has NaN output and lse: the merge is NaN there, and only there."""
    (o1, l1), (o2, l2) = _parts(torch.Generator().manual_seed(6))
    o1[1, 3] = math.nan
    l1[1, 3] = math.nan
    out, lse = foldc.merge_attention([(o1, l1), (o2, l2)])
    assert torch.isnan(out[1, 3]).all() and torch.isnan(lse[1, 3])
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 3] = False
    assert torch.isfinite(out[mask]).all() and torch.isfinite(lse[mask]).all()
    alone, lse1 = foldc.merge_attention([(o1, l1)])   # one NaN part alone stays NaN, never zeros
    assert torch.isnan(alone[1, 3]).all() and torch.isnan(lse1[1, 3])


# ---- NaN from the data through the kernels ------------------------------------------------------

@pytest.mark.parametrize("name", ["k", "v"])
def test_a_nan_in_the_cache_gives_nan_attention_on_every_target(name):
    q, k, v = _inputs(torch.Generator().manual_seed(7))
    x = {"k": k, "v": v}[name]
    x.scale[0, 1, 0, 0] = math.nan   # KV head 1: its query heads 2 and 3 see the NaN
    for target in ("reference", "interpret"):
        out = foldc.compile(SPEC, target=target)(q, k, v)
        assert torch.isnan(out[0, 2:]).any(), target
        assert torch.isfinite(out[0, :2]).all(), target


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(2, 40), cols=st.integers(1, 9), a=st.tuples(st.integers(0, 39), st.integers(1, 40)),
       b=st.tuples(st.integers(0, 39), st.integers(1, 40)), dtype=st.sampled_from([torch.float16, torch.float32]))
def test_an_output_over_an_inputs_rows_is_refused_and_disjoint_rows_are_not(rows, cols, a, b, dtype):
    buf = torch.randn(rows, cols).to(dtype)
    out, x = buf[a[0] % rows:][:a[1]], buf[b[0] % rows:][:b[1]]
    rows_out = set(range(a[0] % rows, a[0] % rows + out.shape[0]))
    rows_x = set(range(b[0] % rows, b[0] % rows + x.shape[0]))
    if rows_out & rows_x:
        with pytest.raises(InputError, match="out shares memory with x"):
            check_no_overlap(out, "out", x=x)
    else:
        check_no_overlap(out, "out", x=x)
    check_no_overlap(out, "out", x=x.clone(), w=None)   # a copy never meets it


def _beside(t: torch.Tensor, shape: tuple, dtype: torch.dtype, shift: int) -> tuple:
    """(a copy of t, an out of ``shape`` and ``dtype``) in one byte buffer, out's first byte ``shift`` bytes from the
    copy's."""
    size = math.prod(shape) * dtype.itemsize
    lo = min(0, shift)
    buf = torch.zeros(max(t.nbytes, shift + size) - lo, dtype=torch.uint8)
    copy = buf[-lo:][:t.nbytes].view(t.dtype).view(t.shape)
    copy.copy_(t)
    return copy, buf[shift - lo:][:size].view(dtype).view(shape)


def _attention_call(entry: str, spec, gen):
    """(the call's inputs by name, the call) of one entry point: a compiled target, or the paged wrapper over
    pools of four pages of 16 tokens."""
    if entry in ("reference", "interpret", "gluon"):
        q, k, v = _inputs(gen, spec=spec) if spec.v is not None else (*_inputs(gen, spec=SPEC)[:2], None)
        if v is None:
            v = torch.randn(1, 2, 32, 64, generator=gen).half()
        if entry == "gluon":
            from foldc.backends.gluon.launch import GluonAttention
            return {"q": q, "k": k, "v": v}, GluonAttention(spec)
        return {"q": q, "k": k, "v": v}, foldc.compile(spec, target=entry)
    target = entry.split("-")[1]
    wrapper = PagedDecodeWrapper(spec, 16, max_seq_len=64, target=target)
    wrapper.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32), None, num_pages=4,
                 seq_lens=[20])
    pools = {f"{n}_pages": foldc.quantize(torch.randn(4, 2, 16, 64, generator=gen), getattr(spec, n))
             if getattr(spec, n) is not None else torch.randn(4, 2, 16, 64, generator=gen).half() for n in "kv"}
    q = torch.randn(1, 4, 64, generator=gen).half()
    return {"q": q, **pools}, lambda q, k_pages, v_pages, out: wrapper.run(q, k_pages, v_pages, out=out)


@settings(max_examples=60, deadline=None)
@given(entry=st.sampled_from(["reference", "interpret", "gluon", "wrapper-reference", "wrapper-interpret"]),
       victim=st.sampled_from(["q", "k.codes", "k.scale", "k.zero", "v", "v.codes", "v.scale", "v.zero"]),
       overlap=st.booleans(), where=st.floats(0, 1), dtype=st.sampled_from([torch.float16, torch.float32]),
       seed=st.integers(0, 2**31 - 1))
def test_an_attention_output_over_q_k_or_v_is_refused_on_every_target(entry, victim, overlap, where, dtype, seed):
    """An out sharing memory with q, a plain side, or an encoded side's codes, scales or zeros was taken: the decode
    kernel writes out while other programs still read them, a silently wrong answer on the GPU. Every target and the
    paged wrapper refuse it by name before anything is written; an out right beside them is taken."""
    spec = foldc.AttentionSpec(4, 2, 64, k=SPEC.k, v=None) if victim == "v" else SPEC
    inputs, call = _attention_call(entry, spec, torch.Generator().manual_seed(seed))
    side, _, part = victim.partition(".")
    name = side if side == "q" or entry in ("reference", "interpret", "gluon") else f"{side}_pages"
    held = getattr(inputs[name], part) if part else inputs[name]
    size = 4 * 64 * dtype.itemsize
    # overlap: out starts from size - 4 bytes before held to 4 bytes before held's end; else right after or before it
    shift = 4 - size + 4 * int(where * (held.nbytes + size - 8) / 4) if overlap else \
        (held.nbytes if where < .5 else -size)
    copy, out = _beside(held, (1, 4, 64), dtype, shift)
    inputs[name] = dataclasses.replace(inputs[name], **{part: copy}) if part else copy
    if overlap:
        before = copy.clone()
        with pytest.raises(InputError, match=re.escape(f"out shares memory with {name + ('.' + part if part else '')}")):
            call(**inputs, out=out)
        assert torch.equal(copy, before)
    elif entry == "gluon":
        with pytest.raises(InputError, match="runs on a CUDA GPU"):
            call(**inputs, out=out)
    else:
        want = call(**inputs, out=torch.empty(1, 4, 64, dtype=dtype))
        assert call(**inputs, out=out) is out and torch.equal(out, want)


def test_an_output_over_an_affine_tensors_scales_is_refused():
    enc = foldc.Affine(bits=4, layout="token", group_size=16)
    t = foldc.quantize(torch.randn(1, 2, 8, 32), enc)
    with pytest.raises(InputError, match="out shares memory with k.scale"):
        check_no_overlap(t.scale.view(-1)[:4], "out", k=t)
    check_no_overlap(torch.empty(4), "out", k=t)


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_overlaps_itself_says_whether_two_elements_share_memory(shape, data):
    """Against every element's offset, on random strides (zero, small, dense, sliced, negative-free): no
    false "no overlap" ever, and dense or sliced views of fresh storage never refused."""
    from foldc.validate import overlaps_itself
    strides = data.draw(st.lists(st.integers(0, 12), min_size=len(shape), max_size=len(shape)))
    reach = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    t = torch.empty(reach).as_strided(shape, strides)
    idx = torch.arange(t.numel()).reshape(shape)   # every element once
    offsets = {sum(i * s for i, s in zip(torch.unravel_index(torch.tensor(j), shape), strides)) for j in
               idx.flatten().tolist()}
    if len(offsets) < t.numel():
        assert overlaps_itself(t)
    dense = torch.empty([n + 1 for n in shape])[tuple(slice(0, n) for n in shape)]
    assert not overlaps_itself(dense) and not overlaps_itself(dense.transpose(0, -1))


def test_every_output_of_expanded_rows_is_refused():
    """An out whose rows share memory (expand) is refused by attention, the paged wrapper and the GEMM."""
    from foldc.gemm import GemmSpec, parse_gemm_encoding, quantize_2d
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, 4, 64, generator=gen).half()
    with pytest.raises(InputError, match="share memory"):
        _wrapper().run(q[:1], page_pool(SPEC, "k", 4, 16), page_pool(SPEC, "v", 4, 16),
                       out=torch.empty(1, 1, 64, dtype=torch.float16).expand(1, 4, 64))
    spec = GemmSpec(n=64, k=128, weight=parse_gemm_encoding("k-group:4:32", "weight"))
    w = quantize_2d(torch.randn(64, 128, generator=gen), spec.weight)
    x = torch.randn(4, 128, generator=gen).half()
    for options in ({}, {"split_k": 2}):
        with pytest.raises(InputError, match="share memory"):
            foldc.compile(spec, "interpret", **options)(x, w, out=torch.empty(64, dtype=torch.float16).expand(4, 64))


def test_small_misuses_are_refused_by_name():
    """Each of these raised an error from inside torch or Python, named the wrong thing, or was accepted until the
    first call: now a FoldError naming the value."""
    from foldc.gemm import GemmSpec, parse_gemm_encoding, quantize_2d
    from foldc.nn import FoldLinear
    gen = torch.Generator().manual_seed(12)
    o, s = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, generator=gen)
    with pytest.raises(InputError, match="part 0: lse is on meta but out is on cpu"):
        foldc.merge_attention([(o, s.to("meta"))])
    big = torch.randn(1, 1, 4, 32, generator=gen, dtype=torch.float64) * 1e39
    with pytest.raises(InputError, match="beyond float32's range"):
        foldc.quantize(big, foldc.Affine(4, "token", 32, torch.float32))
    with pytest.raises(foldc.SpecError, match=r"fold_policy=None must be one of \('auto', 'dequant'\)"):
        foldc.compile(SPEC, "interpret", fold_policy=None)
    with pytest.raises(foldc.SpecError, match="split_prescaled='no' must be True, False or None"):
        foldc.compile(SPEC, "interpret", split_prescaled="no")
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 64), "k-group:4:32")
    with pytest.raises(InputError, match=r"x must be a tensor \[\.\.\., 128\]"):
        layer(torch.tensor(1.0))
    spec = GemmSpec(n=64, k=128, weight=parse_gemm_encoding("k-group:4:32", "weight"))
    w = quantize_2d(torch.randn(64, 128, generator=gen), spec.weight)
    gemm = foldc.compile(spec, "interpret")
    with pytest.raises(InputTypeError, match="out must be a torch.Tensor"):
        gemm(torch.randn(2, 128, generator=gen).half(), w, out=[1])
    empty = gemm(torch.randn(0, 128, generator=gen).half(), w)   # no rows: an empty result, as the reference's
    assert empty.shape == (0, 64) and foldc.compile(spec, "reference")(torch.randn(0, 128).half(), w).shape == (0, 64)


@pytest.mark.parametrize("call, exc, match", [
    (lambda q, k, v: foldc.attention_reference(q, k, v, seq_lens=[9]), InputError, "seq_lens holds 9 but the cache"),
    (lambda q, k, v: foldc.attention_reference(q, k, v, seq_lens=[0]), InputError, "seq_lens holds 0"),
    (lambda q, k, v: foldc.attention_reference(q, k, v, seq_lens=[2.5]), InputError, "must be an integer type"),
    (lambda q, k, v: foldc.attention_reference(q, k, v, seq_lens=[1, 2]), InputError, r"seq_lens shape=\(2,\)"),
    (lambda q, k, v: foldc.attention_reference(q[0], k, v), InputTypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: foldc.attention_reference(q, torch.randn(1, 3, 8, 64), torch.randn(1, 3, 8, 64)), InputError,
     "a multiple of the KV heads"),
    (lambda q, k, v: foldc.attention_reference(q, k, torch.randn(1, 2, 9, 64)), InputError, "k holds 8 tokens but v "
     "holds 9"),
])
def test_the_reference_checks_its_arguments_as_every_target_does(call, exc, match):
    """foldc.attention_reference, the ground truth, refuses what the compiled targets refuse (it capped a length
    past the cache, gave NaN rows for a length of 0 and rounded a length of 2.5)."""
    gen = torch.Generator().manual_seed(13)
    enc = foldc.Affine(4, "token", 32)
    q = torch.randn(1, 4, 64, generator=gen).half()
    k, v = (foldc.quantize(torch.randn(1, 2, 8, 64, generator=gen), enc) for _ in range(2))
    with pytest.raises(exc, match=match):
        call(q, k, v)


@settings(max_examples=10, deadline=None)
@given(target=st.sampled_from(["reference", "interpret"]), seed=st.integers(0, 2**31 - 1))
def test_the_paged_wrapper_checks_the_pools_against_an_out_once_and_q_every_call(target, seed):
    """A serving loop hands the wrapper the same out every step: the pools are checked against it once while they and
    the out's memory stay the same, q (new each step) at every call; a q over the out, or other pools under it, are
    refused as on a first call."""
    gen = torch.Generator().manual_seed(seed)
    inputs, call = _attention_call(f"wrapper-{target}", SPEC, gen)
    k_pages, v_pages = inputs["k_pages"], inputs["v_pages"]
    buf = torch.empty(k_pages.codes.nbytes, dtype=torch.uint8)
    out = buf[:4 * 64 * 2].view(torch.float16).view(1, 4, 64)
    want = call(inputs["q"], k_pages, v_pages, out=torch.empty_like(out)).clone()
    seen = []
    checked = paged_module.check_no_overlap
    with mock.patch.object(paged_module, "check_no_overlap",
                           lambda out, name, **parts: (seen.append(sorted(parts)), checked(out, name, **parts))):
        for _ in range(3):
            assert torch.equal(call(inputs["q"].clone(), k_pages, v_pages, out=out), want)
        assert seen == [["k_pages", "q", "v_pages"], ["q"], ["q"]]
        with pytest.raises(InputError, match="out shares memory with q"):
            call(out.view(-1)[:4 * 64].view(1, 4, 64), k_pages, v_pages, out=out)
        under = buf.view(k_pages.codes.shape)   # other pools, their codes under the out
        under.copy_(k_pages.codes)
        with pytest.raises(InputError, match="out shares memory with k_pages.codes"):
            call(inputs["q"], dataclasses.replace(k_pages, codes=under), v_pages, out=out)


def test_shared_memory_pair_names_parts_that_certainly_overlap_and_no_others():
    """One tensor twice, overlapping slices of one buffer: named; disjoint slices, interleaved columns, meta and fake
    tensors (whose addresses mean nothing): not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from foldc.validate import shared_memory_pair

    a = torch.zeros(4, 8)
    flat = a.view(-1)
    assert shared_memory_pair([a, a]) == (0, 1)
    assert shared_memory_pair([torch.zeros(3), a[1:], a[:2]]) == (1, 2)
    assert shared_memory_pair([flat[3:20], flat[10:12]]) == (0, 1)
    assert shared_memory_pair([a[:2], a[2:]]) is None and shared_memory_pair([a[:, ::2], a[:, 1::2]]) is None
    assert shared_memory_pair([a[:, :4], a[:, 4:], a[:0], torch.zeros(2, device="meta")]) is None
    with FakeTensorMode():
        fake = torch.zeros(3)
    assert shared_memory_pair([fake, fake]) is None


@pytest.mark.parametrize("out_dtype", [torch.float64, torch.float16])
def test_an_out_on_the_meta_device_is_not_taken_for_one_over_the_inputs(out_dtype):
    """The reference target runs on meta tensors (a shape-only run gives meta out and lse), but an out on the meta
    device was refused as 'out shares memory with q (bytes 0x0..)': every meta tensor's data_ptr() is 0, so the
    overlap check saw each input at the out's address. Meta tensors have no memory to share: the call writes the
    out it is given, as on a real device, where an out over q is still refused."""
    q, k, v = _inputs(torch.Generator().manual_seed(21), batch=2)
    meta = [q.to("meta"), k.to("meta"), v.to("meta")]
    attn = foldc.compile(SPEC, target="reference")
    out = torch.empty(2, 4, 64, dtype=out_dtype, device="meta")
    got, lse = attn(*meta, out=out, return_lse=True)
    assert got is out and lse.is_meta and lse.shape == (2, 4)
    want = attn(q, k, v)
    real = torch.full((2, 4, 64), 7.0, dtype=out_dtype)
    assert attn(q, k, v, out=real) is real and torch.allclose(real.double(), want, rtol=1e-2, atol=1e-3)
    q64 = q.double()
    with pytest.raises(InputError, match="out shares memory with q"):
        attn(q64, k, v, out=q64)
