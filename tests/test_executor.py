"""The float64 plan executor (``foldc.compile(spec, target="reference")``) against
`foldc.attention_reference` over the same dequantized cache.

Every case draws fresh random data: layouts, bits, group sizes (channel-wise groups that do not
divide the token count included), GQA ratios, token counts, token tiles, per-sequence lengths
and sm_scale. The plan must match dequantize-then-compute to float64 rounding.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import sympy as sp
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import foldc
from foldc.executor import Executor, SympyOps, TorchOps
from foldc.ir import BATCH, CHANNEL, KV_HEAD, Q_PER_KV, TOKEN, Accumulate

compile_module = importlib.import_module("foldc.compile")  # foldc.compile is the function

REL_TOL = 1e-12
PROP = settings(max_examples=25, deadline=None)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------------
# strategies and helpers
# ------------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def encodings(draw, head_dim: int):
    """None (plain operand) or an Affine valid for head_dim: token-wise groups divide head_dim,
    channel-wise groups are any size 1..48 (they need not divide the token count)."""
    layout = draw(st.sampled_from(["token", "channel", None]))
    if layout is None:
        return None
    bits = draw(st.sampled_from([2, 4, 8]))
    group = draw(st.sampled_from(_divisors(head_dim)) if layout == "token" else st.integers(1, 48))
    return foldc.Affine(bits, layout, group, draw(st.sampled_from(SCALE_DTYPES)))


@st.composite
def cases(draw, fold_only: bool = False):
    head_dim = draw(st.sampled_from([16, 32, 64]))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = draw(st.integers(1, 2))
    spec = foldc.AttentionSpec(ratio * kv_heads, kv_heads, head_dim, k=draw(encodings(head_dim)),
                               v=draw(encodings(head_dim)))
    tokens = draw(st.integers(1, 257))
    batch = draw(st.integers(1, 3))
    return dict(
        spec=spec, batch=batch, tokens=tokens,
        token_tile=draw(st.integers(1, 70)),
        seq_lens=draw(st.lists(st.integers(1, tokens), min_size=batch, max_size=batch)),
        sm_scale=draw(st.floats(0.05, 2.0) | st.floats(-2.0, -0.05)),
        seed=draw(st.integers(0, 2**31 - 1)),
        constant_group=draw(st.booleans()),
        outliers=draw(st.booleans()),
    )


def _cache(gen, batch, kv_heads, tokens, head_dim, shift_range=3.0):
    amp = 0.2 + 3 * torch.rand((), generator=gen, dtype=torch.float64)
    shift = shift_range * (2 * torch.rand((), generator=gen, dtype=torch.float64) - 1)
    return amp * torch.randn(batch, kv_heads, tokens, head_dim, generator=gen, dtype=torch.float64) + shift


def _make_constant_group(x: torch.Tensor, enc, gen) -> None:
    """Make one whole quantization group of x constant (quantizes to scale 0)."""
    if enc is None:
        return
    c = float(torch.randn((), generator=gen)) + 1.5
    if enc.layout == "token":
        x[0, 0, 0, : enc.group_size] = c
    else:  # the first token group of channel 0 (may be partial if tokens < group_size)
        x[0, 0, : enc.group_size, 0] = c


def _add_outliers(k: torch.Tensor, gen) -> list[int]:
    """A few key channels with large magnitude, as real keys have."""
    d = k.shape[-1]
    chans = torch.randperm(d, generator=gen)[:3].tolist()
    for c in chans:
        sign = 1.0 if torch.rand((), generator=gen) < 0.5 else -1.0
        k[..., c] += sign * (20 + 30 * float(torch.rand((), generator=gen)))
    return chans


def _encode(x, enc):
    return x if enc is None else foldc.quantize(x, enc)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == torch.float64
    assert torch.isfinite(out).all()
    rel = ((out - ref).norm() / ref.norm()).item()
    max_abs = (out - ref).abs().max().item()
    note(f"rel L2 {rel:.3e}, max abs {max_abs:.3e}")
    assert rel <= REL_TOL, f"relative L2 error {rel:.3e} > {REL_TOL}"
    assert max_abs <= 1e-11 * ref.abs().max().item(), f"max abs error {max_abs:.3e}"


def _run_case(c):
    spec = c["spec"]
    gen = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["batch"], spec.num_q_heads, spec.head_dim, generator=gen, dtype=torch.float64)
    k = _cache(gen, c["batch"], spec.num_kv_heads, c["tokens"], spec.head_dim)
    v = _cache(gen, c["batch"], spec.num_kv_heads, c["tokens"], spec.head_dim)
    if c["outliers"]:
        _add_outliers(k, gen)
    if c["constant_group"]:  # after the outliers, which would break the constant
        _make_constant_group(k, spec.k, gen)
        _make_constant_group(v, spec.v, gen)
    kq, vq = _encode(k, spec.k), _encode(v, spec.v)
    seq_lens = torch.tensor(c["seq_lens"])
    note(f"{spec.describe()} folds={foldc.plan(spec).folds} tokens={c['tokens']} tile={c['token_tile']}")
    attn = foldc.compile(spec, target="reference", token_tile=c["token_tile"])
    out = attn(q, kq, vq, c["sm_scale"], seq_lens)
    ref = foldc.attention_reference(q, kq, vq, c["sm_scale"], seq_lens)
    _assert_close(out, ref)
    return kq, vq


# ------------------------------------------------------------------------------------------
# property tests
# ------------------------------------------------------------------------------------------

@PROP
@given(cases())
def test_executor_matches_reference_on_random_layouts(c):
    _run_case(c)


# Specs whose products keep their fold (g > 2h), one per layout pair, so every fold kind is run
# whatever the random draw above happened to pick.
FOLD_SPECS = [
    (foldc.AttentionSpec(4, 2, 32, k=foldc.Affine(2, "token", 16), v=foldc.Affine(4, "token", 8)),
     {"qk": "acc-fold", "pv": "operand-fold"}),
    (foldc.AttentionSpec(4, 2, 32, k=foldc.Affine(2, "token", 16), v=foldc.Affine(2, "channel", 13)),
     {"qk": "acc-fold", "pv": "acc-fold"}),
    (foldc.AttentionSpec(4, 2, 32, k=foldc.Affine(4, "channel", 7), v=foldc.Affine(8, "token", 32)),
     {"qk": "operand-fold", "pv": "operand-fold"}),
    (foldc.AttentionSpec(8, 1, 64, k=foldc.Affine(2, "channel", 17), v=foldc.Affine(2, "channel", 33)),
     {"qk": "operand-fold", "pv": "acc-fold"}),
]


@pytest.mark.parametrize("spec,folds", FOLD_SPECS, ids=["tok-tok", "tok-chan", "chan-tok", "chan-chan"])
@settings(max_examples=8, deadline=None)
@given(tokens=st.integers(1, 257), tile=st.integers(1, 70), batch=st.integers(1, 2), seed=st.integers(0, 2**31 - 1),
       sm_scale=st.floats(0.05, 2.0), data=st.data())
def test_each_fold_kind_matches_reference(spec, folds, tokens, tile, batch, seed, sm_scale, data):
    assert foldc.plan(spec).folds == folds  # precondition: the layout really exercises this fold
    seq_lens = data.draw(st.lists(st.integers(1, tokens), min_size=batch, max_size=batch))
    _run_case(dict(spec=spec, batch=batch, tokens=tokens, token_tile=tile, seq_lens=seq_lens, sm_scale=sm_scale,
                   seed=seed, constant_group=False, outliers=False))


@PROP
@given(c=cases(), which=st.sampled_from(["k", "v"]), bits=st.sampled_from([2, 4, 8]),
       layout=st.sampled_from(["token", "channel"]), data=st.data())
def test_constant_group_quantizes_to_zero_scale_and_still_matches(c, which, bits, layout, data):
    """A constant group gets scale 0 and codes 0; the plan must still reproduce its zero."""
    spec = c["spec"]
    group = data.draw(st.sampled_from(_divisors(spec.head_dim)) if layout == "token" else st.integers(1, 48))
    enc = foldc.Affine(bits, layout, group)
    spec = foldc.AttentionSpec(spec.num_q_heads, spec.num_kv_heads, spec.head_dim,
                               k=enc if which == "k" else spec.k, v=enc if which == "v" else spec.v)
    kq, vq = _run_case({**c, "spec": spec, "constant_group": True})
    quantized = kq if which == "k" else vq
    assert (quantized.scale == 0).any(), "the constant group did not quantize to scale 0"


@PROP
@given(cases())
def test_large_outlier_key_channels(c):
    """Keys with a few channels of magnitude 20..50 (peaked softmax, large logits) still match.
    (No constant group here: one made after the outliers can cover the whole key, e.g. one token
    with one group of head_dim channels, and flatten them.)"""
    kq, _ = _run_case({**c, "outliers": True, "constant_group": False})
    k = kq.dequantize(torch.float64) if isinstance(kq, foldc.AffineTensor) else kq
    assert k.abs().max() > 15


# ------------------------------------------------------------------------------------------
# dequant plans (break-even fails)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout_k,layout_v", [("token", "token"), ("token", "channel"), ("channel", "channel")])
@settings(max_examples=8, deadline=None)
@given(tokens=st.integers(1, 200), tile=st.integers(1, 70), seed=st.integers(0, 2**31 - 1),
       sm_scale=st.floats(0.05, 1.0), data=st.data())
def test_dequant_plan_matches_reference(layout_k, layout_v, tokens, tile, seed, sm_scale, data):
    """16 query heads on one KV head and groups of 16: 2*h/g = 2 >= 1, so both products dequantize."""
    spec = foldc.AttentionSpec(16, 1, 32, k=foldc.Affine(4, layout_k, 16), v=foldc.Affine(2, layout_v, 16))
    assert foldc.plan(spec).folds == {"qk": "dequant", "pv": "dequant"}
    seq_lens = data.draw(st.lists(st.integers(1, tokens), min_size=2, max_size=2))
    _run_case(dict(spec=spec, batch=2, tokens=tokens, token_tile=tile, seq_lens=seq_lens, sm_scale=sm_scale,
                   seed=seed, constant_group=True, outliers=True))


# ------------------------------------------------------------------------------------------
# the tile loop itself
# ------------------------------------------------------------------------------------------

@settings(max_examples=10, deadline=None)
@given(c=cases(), tiles=st.lists(st.integers(1, 70), min_size=2, max_size=2, unique=True))
def test_token_tile_does_not_change_the_result(c, tiles):
    """Two tilings of the online softmax agree with each other to float64 rounding."""
    spec = c["spec"]
    gen = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["batch"], spec.num_q_heads, spec.head_dim, generator=gen)
    kq = _encode(_cache(gen, c["batch"], spec.num_kv_heads, c["tokens"], spec.head_dim), spec.k)
    vq = _encode(_cache(gen, c["batch"], spec.num_kv_heads, c["tokens"], spec.head_dim), spec.v)
    a, b = (foldc.compile(spec, token_tile=t)(q, kq, vq, c["sm_scale"], c["seq_lens"]) for t in tiles)
    assert ((a - b).norm() / b.norm()).item() <= REL_TOL


def test_executor_rejects_token_tile_below_one():
    spec = FOLD_SPECS[0][0]
    the_plan = foldc.plan(spec)
    with pytest.raises(foldc.GraphError, match=r"token_tile=0 must be >= 1"):
        Executor(the_plan.graph, TorchOps(), {}, {}, 5, 1.0, 0)


def test_executor_with_sympy_ops_agrees_with_torch_ops():
    """The same graph run on exact sympy numbers (SympyOps) and on float64 torch (TorchOps).

    SympyOps leaves each tile's running maximum as a free symbol; the accumulator over the
    denominator must not depend on them, so any substitution gives the float64 result.
    """
    spec = foldc.AttentionSpec(4, 2, 16, k=foldc.Affine(2, "token", 8), v=foldc.Affine(4, "channel", 5))
    the_plan = foldc.plan(spec)
    assert the_plan.folds == {"qk": "acc-fold", "pv": "acc-fold"}
    gen = torch.Generator().manual_seed(1234)
    batch, tokens, tile, sm_scale = 1, 7, 3, 0.375
    q = torch.randn(batch, 4, 16, generator=gen)
    kq = foldc.quantize(torch.randn(batch, 2, tokens, 16, generator=gen), spec.k)
    vq = foldc.quantize(torch.randn(batch, 2, tokens, 16, generator=gen), spec.v)
    bindings = compile_module.bind_inputs(spec, q, kq, vq)
    sizes = {BATCH: batch, KV_HEAD: 2, Q_PER_KV: 2, CHANNEL: 16, TOKEN: tokens}

    num = Executor(the_plan.graph, TorchOps(), bindings, sizes, tokens, sm_scale, tile).run()
    # exact rationals: every float64 is a binary fraction
    sym_bindings = {key: np.vectorize(lambda x: sp.Rational(float(x)), otypes=[object])(t.numpy())
                    for key, t in bindings.items()}
    sym = Executor(the_plan.graph, SympyOps(), sym_bindings, sizes, tokens, sp.Rational(sm_scale), tile).run()

    acc = the_plan.graph.nodes_of(Accumulate)[0].name
    maxima = sorted({s for e in np.ravel(sym["__max__"].data) for s in [e] if isinstance(s, sp.Symbol)} |
                    {s for e in np.ravel(sym[acc].data) for s in e.free_symbols}, key=str)
    assert maxima, "SympyOps should leave the running maxima symbolic"
    rng = np.random.default_rng(7)
    subs = {m: sp.Float(rng.normal(), 30) for m in maxima}
    sym_out = np.vectorize(lambda a, l: float((a / l).subs(subs).evalf(30)), otypes=[float])(
        sym[acc].data, sym["__denominator__"].data[..., None])
    num_out = (num[the_plan.graph.output].data).numpy()
    np.testing.assert_allclose(sym_out, num_out, rtol=1e-12, atol=0)
    ref = foldc.attention_reference(q, kq, vq, sm_scale).reshape(num_out.shape).numpy()
    np.testing.assert_allclose(sym_out, ref, rtol=1e-12, atol=0)
