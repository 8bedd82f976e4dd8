"""The generated Triton kernel under Triton's interpreter (target="interpret", CPU, fp16).

Each case draws fresh random inputs, runs the kernel into a NaN-poisoned ``out=`` and compares
with float64 attention over the same dequantized cache (foldc.testing.run_case). Interpreter
dots are exact-ish, so the fp16 kernel lands near 3e-4 relative L2; the bar is 2e-3 and, in
any case, no worse than plain bf16 attention over the same values.

Cases cover the 9 K/V layout pairs (token, channel, plain), bits 2/4/8, group sizes 16-128,
GQA ratios 1-16 and head_dim 32/64/128, spread across cases rather than a full product; plus
dequant plans, forced split counts, sequence lengths that are not multiples of the tile or the
group, the generated source, and the callable's argument checks.
"""
from __future__ import annotations

import pytest
import torch
from _kernel_cases import run_with_lens

import foldc
from foldc.errors import InputError, SpecError, UnsupportedError
from foldc.testing import run_case

A = foldc.Affine
S = foldc.AttentionSpec
F16 = torch.float16
TOL = 2e-3

ACC, OPF, DEQ, NONE = "acc-fold", "operand-fold", "dequant", "none"

# (id, spec, batch, tokens, block_n, expected folds (qk, pv)). Token counts are not multiples of
# block_n or of any channel-wise group size, so the last tile and the last group are partial;
# run_case draws the other sequences' lengths at random in [tokens/2, tokens].
CASES = [
    # the 9 K/V layout pairs
    ("K-token2-g32_V-token4-g32_r4_d64", S(8, 2, 64, A(2, "token", 32), A(4, "token", 32)), 2, 150, 16, (ACC, OPF)),
    ("K-token4-g64_V-channel2-g32_r8_d64", S(16, 2, 64, A(4, "token", 64), A(2, "channel", 32)), 2, 133, 32,
     (ACC, ACC)),
    ("K-token8-g64_V-plain_r1_d128", S(2, 2, 128, A(8, "token", 64), None), 2, 77, 16, (ACC, NONE)),
    ("K-channel2-g64_V-token8-g64_r16_d64", S(32, 2, 64, A(2, "channel", 64), A(8, "token", 64)), 2, 200, 32,
     (OPF, OPF)),
    ("K-channel8-g16_V-channel4-g16_r2_d32", S(4, 2, 32, A(8, "channel", 16), A(4, "channel", 16)), 3, 100, 16,
     (OPF, ACC)),
    ("K-channel4-g32_V-plain_r4_d128", S(8, 2, 128, A(4, "channel", 32), None), 2, 90, 32, (OPF, NONE)),
    ("K-plain_V-token2-g32_r8_d64", S(16, 2, 64, None, A(2, "token", 32)), 2, 150, 16, (NONE, OPF)),
    ("K-plain_V-channel8-g64_r2_d128", S(4, 2, 128, None, A(8, "channel", 64)), 2, 140, 32, (NONE, ACC)),
    ("K-plain_V-plain_r4_d64", S(8, 2, 64), 2, 61, 16, (NONE, NONE)),
    # more group sizes / head dims / bit widths
    ("K-token2-g128_V-channel2-g128_r4_d128", S(8, 2, 128, A(2, "token", 128), A(2, "channel", 128)), 1, 180, 32,
     (ACC, ACC)),
    ("K-token4-g16_V-token4-g16_r1_d32", S(2, 2, 32, A(4, "token", 16), A(4, "token", 16)), 2, 45, 16, (ACC, OPF)),
    ("K-token4-g32_V-channel8-g32_r2_d128_fp32scale",
     S(4, 2, 128, A(4, "token", 32, torch.float32), A(8, "channel", 32, torch.bfloat16)), 2, 99, 16, (ACC, ACC)),
    # dequant plans: group_size <= 2 * (query heads per KV head) fails break-even (eq. 12)
    ("dequant_K-token2-g16_V-channel4-g16_r16_d64", S(32, 2, 64, A(2, "token", 16), A(4, "channel", 16)), 1, 100, 16,
     (DEQ, DEQ)),
    ("dequant_K-channel8-g32_V-token4-g32_r16_d64", S(32, 2, 64, A(8, "channel", 32), A(4, "token", 32)), 2, 70, 32,
     (DEQ, DEQ)),
    ("mixed_K-token4-g16-dequant_V-token2-g64-fold_r8_d64", S(16, 2, 64, A(4, "token", 16), A(2, "token", 64)), 2, 83,
     16, (DEQ, OPF)),
    # head_dims between powers of two: chunks of 16 or more channels inside one bit field (48 per field at
    # INT4 and 96 at INT8 for head_dim 96, 40 at INT8 for 80, a plain side at 48), and fields of a number of
    # channels no multiple of 16 ending in a padded chunk (24 at INT2 for 96, 20 for 80, 28 at INT4 for 112)
    ("K-token2-g96_V-token2-g96_r4_d96_padded", S(8, 2, 96, A(2, "token", 96), A(2, "token", 96)), 2, 97, 32,
     (ACC, OPF)),
    ("K-token2-g48_V-channel2-g32_r8_d96_padded", S(16, 2, 96, A(2, "token", 48), A(2, "channel", 32)), 2, 70, 32,
     (ACC, ACC)),
    ("K-channel4-g64_V-token2-g80_r2_d80_padded", S(4, 2, 80, A(4, "channel", 64), A(2, "token", 80)), 2, 81, 16,
     (OPF, OPF)),
    ("K-token4-g112_V-plain_r4_d112_padded", S(8, 2, 112, A(4, "token", 112), None), 2, 60, 16, (ACC, NONE)),
    ("K-channel2-g32_V-plain_r2_d32_padded", S(4, 2, 32, A(2, "channel", 32), None), 2, 75, 16, (OPF, NONE)),
    ("K-token4-g96_V-token4-g96_r4_d96", S(8, 2, 96, A(4, "token", 96), A(4, "token", 96)), 2, 101, 32, (ACC, OPF)),
    ("K-channel4-g32_V-token8-g96_r2_d96", S(4, 2, 96, A(4, "channel", 32), A(8, "token", 96)), 2, 77, 32,
     (OPF, OPF)),
    ("K-token8-g80_V-channel8-g64_r4_d80", S(8, 2, 80, A(8, "token", 80), A(8, "channel", 64)), 2, 90, 16,
     (ACC, ACC)),
    ("K-plain_V-token8-g48_r4_d48", S(8, 2, 48, None, A(8, "token", 48)), 2, 66, 16, (NONE, OPF)),
]


def _check(result, what: str) -> None:
    assert result.unwritten == 0, f"{what}: {result.unwritten} output elements were never written"
    assert result.error <= TOL, f"{what}: relative L2 {result.error:.3e} > {TOL}"
    assert result.error <= result.bf16_error, (
        f"{what}: error {result.error:.3e} exceeds plain bf16 attention's {result.bf16_error:.3e}")


@pytest.mark.parametrize("spec,batch,tokens,block_n,folds", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_matches_float64(spec, batch, tokens, block_n, folds):
    attn = foldc.compile(spec, "interpret", block_n=block_n)
    assert tuple(attn.plan_for(F16).folds.values()) == folds
    seed = sum(map(ord, spec.describe())) + tokens
    _check(run_case(attn, spec, batch, tokens, F16, "cpu", seed), spec.describe())


SPLIT_SPEC = S(8, 2, 64, A(2, "token", 32), A(2, "channel", 32))


@pytest.mark.parametrize("splits", [None, 1, 3, 7, 64], ids=lambda s: f"splits={s}")
def test_split_counts(splits):
    """Forced split counts (64 is more than the tiles: capped at one tile per split) and the
    default; the merge kernel (eq. 14) must combine them to the same answer."""
    opts = {} if splits is None else {"splits": splits}
    attn = foldc.compile(SPLIT_SPEC, "interpret", block_n=16, **opts)
    _check(run_case(attn, SPLIT_SPEC, 2, 150, F16, "cpu", seed=11), f"splits={splits}")


def test_split_results_agree():
    """One input, several split counts: the outputs agree to fp16 rounding of the merge."""
    outs = []
    for splits in (1, 2, 5):
        attn = foldc.compile(SPLIT_SPEC, "interpret", block_n=16, splits=splits)
        r = run_with_lens(attn, SPLIT_SPEC, [150, 101], 150, F16, "cpu", seed=5)
        assert r.unwritten == 0 and r.error <= TOL, (splits, r.error, r.unwritten)
        outs.append(r.out.double())
    for other in outs[1:]:
        assert ((other - outs[0]).norm() / outs[0].norm()).item() <= 1e-3


def test_ragged_seq_lens_with_empty_splits():
    """Lengths 1, 15, 17, 33, 65 and the full 130 (block_n 16, channel group 32) with 3 splits
    of 48 tokens: short sequences leave whole splits empty, which the merge must ignore."""
    spec = S(8, 2, 64, A(4, "channel", 32), A(2, "token", 32))
    attn = foldc.compile(spec, "interpret", block_n=16, splits=3)
    r = run_with_lens(attn, spec, [130, 1, 15, 17, 33, 65], 130, F16, "cpu", seed=3)
    got, ref = r.out, r.ref
    assert r.unwritten == 0
    assert r.error <= TOL
    # each sequence on its own, so one good row cannot hide a bad one
    for b in range(got.shape[0]):
        rb = ((got[b].double() - ref[b]).norm() / ref[b].norm()).item()
        assert rb <= TOL, f"sequence {b}: relative L2 {rb:.3e}"


def test_channel_group_narrows_token_tile():
    """Channel-wise groups of 16 cannot hold a 32-token tile: the backend tiles by 16 (the
    plan's tiling constraint), and the result is still right with a partial last group."""
    spec = S(4, 2, 64, A(4, "channel", 16), A(4, "channel", 16))
    attn = foldc.compile(spec, "interpret", block_n=32)
    assert "x 16 tokens" in attn.source(F16)
    _check(run_case(attn, spec, 2, 57, F16, "cpu", seed=21), spec.describe())


# -- the generated source reflects the plan ------------------------------------------------------

def _src(k, v, heads=(8, 2), head_dim=64, dtype=F16, block_n=16):
    return foldc.compile(S(*heads, head_dim, k, v), "interpret", block_n=block_n).source(dtype)


def test_source_acc_fold_key_folds_code_bias_into_zero():
    """bf16: the OR trick's 128 folded into the zero (eq. 7); fp16: its 1024 breaks the error bar of
    eq. 6a (code_bias_allowed), so it is subtracted per value and the zero carries none."""
    src = _src(A(2, "token", 32), None, dtype=torch.bfloat16)
    assert "scores_partial_g0" in src and "scores_partial_g1" in src  # one partial per channel group
    assert "k_zero_g0" in src
    assert "- 128.0 * k_scale_g0" in src        # eq. 7: the OR-trick bias folded into the zero
    assert "| 17152" in src                      # 0x4300: bf16 128 + code
    assert "K_VALUES" not in src and "V_VALUES" in src
    assert "_deq_" not in src
    half = _src(A(2, "token", 32), None)
    assert "| 25600" in half and "k_code_c0 - 1024.0" in half   # 0x6400: fp16 1024 + code, then - 1024
    assert "1024.0 * k_scale" not in half


def test_source_operand_fold_value_prescales_weights():
    src = _src(None, A(2, "token", 32))
    assert "pv_prescaled_g0" in src and "pv_offset_g0" in src
    assert "v_code_c0 - 1024.0" in src          # value codes: bias subtracted per value
    assert "K_VALUES" in src and "K_CODES" not in src


def test_source_operand_fold_key_and_acc_fold_value():
    src = _src(A(4, "channel", 32), A(4, "channel", 32))
    assert "scores_prescaled_c0" in src
    assert "- 1024.0 * tl.sum(scores_prescaled_c0" in src  # folded bias corrected on the pre-scaled q
    assert "pv_partial_c0" in src and "pv_offset_psum" in src
    assert "scores_partial_g" not in src and "pv_prescaled" not in src


def test_source_dequant():
    src = _src(A(2, "token", 16), A(4, "channel", 16), heads=(32, 2))
    assert "k_deq_c0" in src and "v_deq_c0" in src
    assert "prescaled" not in src and "scores_partial" not in src and "_offset" not in src


def test_source_bf16_uses_bf16_magic():
    src = _src(A(2, "token", 32), A(2, "token", 32), dtype=torch.bfloat16)
    assert "| 17152" in src                       # 0x4300: bf16 128 + code
    assert "- 128.0 * k_scale_g0" in src and "v_code_c0 - 128.0" in src
    assert "tl.bfloat16" in src and "tl.float16" not in src


def test_source_plain():
    src = _src(None, None)
    assert "K_VALUES" in src and "V_VALUES" in src and "CODES" not in src and "SCALE" not in src


def test_source_deterministic_and_layout_specific():
    k, v = A(2, "token", 32), A(2, "channel", 32)
    first = _src(k, v)
    again = foldc.compile(S(8, 2, 64, A(2, "token", 32), A(2, "channel", 32)), "interpret", block_n=16).source(F16)
    assert first == again
    others = {_src(kk, vv) for kk, vv in [(A(2, "channel", 32), v), (k, A(2, "token", 32)),
                                          (A(4, "token", 32), v), (k, None)]}
    assert first not in others and len(others) == 4
    assert _src(k, v, block_n=32) != first        # tile geometry is baked into the source


# -- argument checks of the Triton callable -------------------------------------------------------

VSPEC = S(4, 2, 64, A(2, "token", 32), A(4, "channel", 32))


@pytest.fixture(scope="module")
def vattn():
    return foldc.compile(VSPEC, "interpret", block_n=16)


@pytest.fixture
def vinputs():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 64, generator=gen).to(F16)
    k = foldc.quantize(torch.randn(2, 2, 40, 64, generator=gen), VSPEC.k)
    v = foldc.quantize(torch.randn(2, 2, 40, 64, generator=gen) + 0.5, VSPEC.v)
    return q, k, v


def _raises(exc, call, *fragments):
    with pytest.raises(exc) as info:
        call()
    assert isinstance(info.value, foldc.FoldError)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def test_valid_call_writes_out(vattn, vinputs):
    q, k, v = vinputs
    out = torch.full((2, 4, 64), float("nan"), dtype=F16)
    got = vattn(q, k, v, out=out)
    assert got is out and not torch.isnan(out).any()
    ref = foldc.attention_reference(q, k, v)
    assert ((got.double() - ref).norm() / ref.norm()).item() <= TOL
    fresh = vattn(q, k, v)
    assert fresh.dtype == F16 and fresh.shape == (2, 4, 64)
    assert torch.equal(fresh, out)


def test_strided_query_and_out_views(vattn, vinputs):
    """q and out may be views with unit stride along head_dim (e.g. slices of a fused buffer):
    the kernel reads q and writes out through their strides, and nothing outside the view."""
    q, k, v = vinputs
    q_wide = torch.randn(2, 4, 96, generator=torch.Generator().manual_seed(8)).to(F16)
    q_wide[:, :, 16:80] = q
    q_view = q_wide[:, :, 16:80]
    big = torch.full((3, 6, 80), float("nan"), dtype=F16)
    out = big[1:, 1:5, 8:72]
    assert not q_view.is_contiguous() and not out.is_contiguous()
    vattn(q_view, k, v, out=out)
    assert not torch.isnan(out).any()
    assert int(torch.isnan(big).sum()) == big.numel() - out.numel()
    assert torch.equal(out, vattn(q, k, v))


def test_bf16_query_under_interpreter(vattn, vinputs):
    q, k, v = vinputs
    _raises(InputError, lambda: vattn(q.to(torch.bfloat16), k, v), "dtype=torch.bfloat16", "torch.float16")


def test_fp32_query_under_interpreter(vattn, vinputs):
    q, k, v = vinputs
    _raises(InputError, lambda: vattn(q.float(), k, v), "dtype=torch.float32", "torch.float16")


def test_non_contiguous_codes(vattn, vinputs):
    q, k, v = vinputs
    codes = k.codes.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strided
    assert not codes.is_contiguous()
    k_strided = foldc.AffineTensor(codes, k.scale, k.zero, k.encoding, k.head_dim)
    _raises(InputError, lambda: vattn(q, k_strided, v), "k must be contiguous", ".contiguous()")


def test_non_contiguous_scale(vattn, vinputs):
    q, k, v = vinputs
    scale = v.scale.transpose(1, 2).contiguous().transpose(1, 2)
    v_strided = foldc.AffineTensor(v.codes, scale, v.zero, v.encoding, v.head_dim)
    _raises(InputError, lambda: vattn(q, k, v_strided), "v must be contiguous", ".contiguous()")


def test_query_stride(vattn, vinputs):
    q, k, v = vinputs
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    _raises(InputError, lambda: vattn(q_t, k, v), "unit stride along head_dim", str(q_t.stride()))


def test_plain_operand_dtype_must_match_query():
    spec = S(4, 2, 64, None, None)
    attn = foldc.compile(spec, "interpret", block_n=16)
    q = torch.randn(1, 4, 64).to(F16)
    kv = torch.randn(1, 2, 20, 64)
    _raises(InputError, lambda: attn(q, kv, kv.to(F16)), "k dtype=torch.float32", "q dtype=torch.float16")
    _raises(InputError, lambda: attn(q, kv.to(F16), kv.to(torch.bfloat16)), "v dtype=torch.bfloat16")


def test_out_wrong_shape(vattn, vinputs):
    q, k, v = vinputs
    _raises(InputError, lambda: vattn(q, k, v, out=torch.empty(2, 4, 32, dtype=F16)),
            "shape=(2, 4, 32)", "(2, 4, 64)")


def test_out_wrong_dtype(vattn, vinputs):
    q, k, v = vinputs
    _raises(InputError, lambda: vattn(q, k, v, out=torch.empty(2, 4, 64, dtype=torch.float64)),
            "dtype=torch.float64", "use one of float16, float32")


def test_float32_out_keeps_the_unrounded_output(vattn, vinputs):
    """A float32 ``out`` receives the merged output before any rounding to q's dtype: it rounds to
    exactly the fp16 result, and sits closer to float64 than that result does."""
    q, k, v = vinputs
    out = torch.full((2, 4, 64), float("nan"), dtype=torch.float32)
    got, lse = vattn(q, k, v, out=out, return_lse=True)
    assert got is out and not torch.isnan(out).any()
    rounded = vattn(q, k, v)
    assert torch.equal(out.to(F16), rounded)
    ref = foldc.attention_reference(q, k, v)
    assert (out.double() - ref).norm() <= (rounded.double() - ref).norm()


def test_a_query_that_records_gradients_gets_outputs_whose_backward_raises(vattn, vinputs):
    """The kernel has no backward: its output had no grad_fn, so a loss through it trained the rest of a model and
    never q, silently. Now out (and the lse) raise by name at backward, with the same values; under no_grad, or for
    a q that records no gradient, the call is as before (the ``out`` given is what comes back)."""
    q, k, v = vinputs
    qg = q.clone().requires_grad_()
    got, lse = vattn(qg, k, v, return_lse=True)
    assert got.requires_grad and lse.requires_grad
    for y in (got, lse):
        with pytest.raises(UnsupportedError, match=r"^the attention kernel .* has no backward.*target='reference'"):
            y.float().sum().backward()
    plain, plain_lse = vattn(q, k, v, return_lse=True)
    assert torch.equal(got.detach(), plain) and torch.equal(lse.detach(), plain_lse)
    assert not plain.requires_grad and not plain_lse.requires_grad
    out = torch.empty_like(q)
    with torch.no_grad():
        assert vattn(qg, k, v, out=out) is out and not out.requires_grad


def test_a_plain_side_that_records_gradients_gets_an_output_whose_backward_raises():
    spec = S(4, 2, 64, A(4, "token", 32), None)
    attn = foldc.compile(spec, "interpret", block_n=16)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 64, generator=gen).to(F16)
    k = foldc.quantize(torch.randn(1, 2, 20, 64, generator=gen), spec.k)
    v = torch.randn(1, 2, 20, 64, generator=gen).to(F16).requires_grad_()
    got = attn(q, k, v)
    with pytest.raises(UnsupportedError, match="has no backward"):
        torch.autograd.grad(got.float().sum(), v)


def test_out_not_unit_stride(vattn, vinputs):
    q, k, v = vinputs
    out = torch.empty(2, 64, 4, dtype=F16).transpose(1, 2)
    _raises(InputError, lambda: vattn(q, k, v, out=out), "unit stride along its last axis")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine with no CUDA GPU")
@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
def test_gpu_target_without_gpu(target):
    _raises(SpecError, lambda: foldc.compile(VSPEC, target), f"target={target!r}", "no", "interpret",
            "foldc compile")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine with no CUDA GPU")
def test_auto_target_without_gpu_interprets():
    from foldc.backends.triton import TritonAttention

    attn = foldc.compile(VSPEC, "auto", block_n=16)
    assert isinstance(attn, TritonAttention) and attn.interpret


def test_unknown_option():
    _raises(SpecError, lambda: foldc.compile(VSPEC, "interpret", blocks=16), "['blocks']", "block_n")


@pytest.mark.parametrize("block_n", [24, 8, 0, "32", True])
def test_bad_block_n(block_n):
    _raises(SpecError, lambda: foldc.compile(VSPEC, "interpret", block_n=block_n), f"block_n={block_n!r}",
            "power of two")


@pytest.mark.parametrize("splits", [0, -2, 1.5])
def test_bad_splits(splits):
    _raises(SpecError, lambda: foldc.compile(VSPEC, "interpret", splits=splits), f"splits={splits!r}",
            "positive integer")


def test_bad_num_warps():
    _raises(SpecError, lambda: foldc.compile(VSPEC, "interpret", num_warps=3), "num_warps=3", "power of two")


def test_bad_num_stages():
    _raises(SpecError, lambda: foldc.compile(VSPEC, "interpret", num_stages=0), "num_stages=0", "positive integer")


def test_token_group_below_tensor_core_minimum():
    spec = S(4, 2, 64, A(2, "token", 8), None)
    _raises(SpecError, lambda: foldc.compile(spec, "interpret"), "head_dim=64", "token:2:8", "8 channels",
            "tensor-core minimum of 16", "larger group_size")


def test_channel_group_admits_no_tile():
    spec = S(4, 2, 64, None, A(4, "channel", 24))
    _raises(SpecError, lambda: foldc.compile(spec, "interpret"), "group_size=[24]", "inside one group",
            "multiple of 16")


def test_head_dim_not_a_multiple_of_16():
    _raises(SpecError, lambda: foldc.compile(S(4, 2, 40), "interpret"), "head_dim=40", "multiple of 16")


def test_padded_chunk_across_a_group_refused():
    """INT2 at head_dim 96 in groups of 32: a bit field holds 24 channels, so its second chunk of 16
    (channels 24..39 of the cache, padded) would cross a group boundary (the register-operand kernel
    takes it with masked groups, bf16 queries)."""
    spec = S(4, 2, 96, A(2, "token", 32), A(2, "token", 96))
    _raises(SpecError, lambda: foldc.compile(spec, "interpret"), "head_dim=96", "channels 24..39",
            "cross a group of 32", "larger group_size")


@pytest.mark.parametrize("k_layout,v_layout", [("channel", "token"), ("channel", "channel"), ("token", "token")])
def test_split_prescaled_operands_are_exact_and_more_accurate(k_layout, v_layout):
    """hi + lo pre-scaled operands (the bf16 default, forced here in fp16) keep the answer and
    never lose accuracy; the generated source shows the second MMA term."""
    from foldc.testing import run_case

    spec = foldc.AttentionSpec(8, 2, 64, foldc.Affine(2, k_layout, 32), foldc.Affine(4, v_layout, 32))
    plain = run_case(foldc.compile(spec, "interpret", split_prescaled=False), spec, 2, 90, torch.float16, "cpu", 11)
    attn = foldc.compile(spec, "interpret", split_prescaled=True)
    split = run_case(attn, spec, 2, 90, torch.float16, "cpu", 11)
    assert split.unwritten == 0 and split.error < 2e-3
    assert split.error <= plain.error * 1.05
    assert "_lo = (" in attn.source(torch.float16)



# -- pre-scaled operands in fp16's range -------------------------------------------------------------------------

def _against_plain(spec, q, k, v, split):
    from foldc.reference import attention_reference
    from foldc.testing import plain_attention, rel_l2
    lens = torch.full((q.shape[0],), k.shape[2])
    out = foldc.compile(spec, "interpret", split_prescaled=split)(q, k, v)
    ref = attention_reference(q, k, v)
    return out, rel_l2(out, ref), rel_l2(plain_attention(q, k, v, 64 ** -0.5, lens), ref)


@pytest.mark.parametrize("split", [False, True], ids=["single", "hi+lo"])
@pytest.mark.parametrize("v_layout", ["token", "channel"])
def test_a_pre_scaled_query_past_65504_stays_finite(v_layout, split):
    """Channel-wise K pre-scales q by the key's scale in fp16 (operand-fold): q ~ 100 against keys ~ 1e3 (scale
    ~ 400 at INT4) made q x s inf and every score NaN, silently, where plain fp16 attention over the same values
    (fp32 scores) is exact to 2e-4. The product is taken at a power of two 2^e per tile (|q x s x 2^e| < |q|)."""
    gen = torch.Generator().manual_seed(21)
    spec = S(4, 2, 64, A(4, "channel", 32), A(4, v_layout, 32))
    q = (torch.randn(2, 4, 64, generator=gen) * 100).half()
    k = foldc.quantize(torch.randn(2, 2, 70, 64, generator=gen) * 1e3, spec.k)
    v = foldc.quantize(torch.randn(2, 2, 70, 64, generator=gen) + 0.5, spec.v)
    out, error, plain = _against_plain(spec, q, k, v, split)
    assert torch.isfinite(out).all()
    assert error <= 2 * plain


@pytest.mark.parametrize("split", [False, True], ids=["single", "hi+lo"])
@pytest.mark.parametrize("k_layout,bits,magnitude", [("token", 8, 1e-3), ("channel", 8, 3e-3), ("token", 4, 1e-5)])
def test_pre_scaled_weights_of_small_values_keep_their_digits(k_layout, bits, magnitude, split):
    """Token-wise V pre-scales P (<= 1) by the value's scale in fp16: INT8 values ~ 1e-3 (scale ~ 2e-5) made
    P x s an fp16 subnormal (steps of 2^-24) that kept few digits: 50x plain fp16 attention's error over the
    same values (and 1e-5 at INT4 rounded it to 0). Taken at a power of two 2^e per tile (P x s x 2^e < 2^15),
    within the bar of eq. 6a (2x plain attention's error) again."""
    gen = torch.Generator().manual_seed(bits + int(1 / magnitude) % 97)
    spec = S(4, 2, 64, A(4, k_layout, 32), A(bits, "token", 32))
    q = torch.randn(2, 4, 64, generator=gen).half()
    k = foldc.quantize(torch.randn(2, 2, 90, 64, generator=gen), spec.k)
    v = foldc.quantize((torch.randn(2, 2, 90, 64, generator=gen) + 0.5) * magnitude, spec.v)
    out, error, plain = _against_plain(spec, q, k, v, split)
    assert torch.isfinite(out).all()
    assert error <= 2 * plain


@pytest.mark.parametrize("bits", [2, 4])
def test_a_small_query_against_large_channel_wise_keys_keeps_its_digits(bits):
    """The query's 2^e puts max |q x s| x 2^e in [2^14, 2^15). Taken from the key's scale alone (|q x s x 2^e|
    < |q|), a query ~1e-4 against keys ~2e4 (logits ~1) went among fp16 subnormals: hi + lo (the fp16 default
    here) kept a few bits, 1.3-2.4x plain fp16 attention's error where it is 0.6-0.8x. A query that is 0 bounds
    no 2^e (2^126): s x 2^e passes float32's range, so q x s is taken first (0, not 0 x inf = NaN)."""
    gen = torch.Generator()
    gen.seed()
    spec = S(4, 2, 64, A(bits, "channel", 32), A(4, "token", 32))
    q = torch.randn(2, 4, 64, generator=gen) * 1e-4
    q[..., torch.randperm(64, generator=gen)[:4]] = 0.0
    q = q.half()
    k = foldc.quantize((torch.randn(2, 2, 90, 64, generator=gen) * 2e4).clamp(-6e4, 6e4), spec.k)
    v = foldc.quantize(torch.randn(2, 2, 90, 64, generator=gen) + 0.5, spec.v)
    out, error, plain = _against_plain(spec, q, k, v, None)
    assert torch.isfinite(out).all()
    assert error <= plain, f"seed {gen.initial_seed()}: {error:.3e} vs plain fp16 attention's {plain:.3e}"
    out, error, plain = _against_plain(spec, torch.zeros_like(q), k, v, None)
    assert torch.isfinite(out).all() and error <= 2 * plain


def test_only_fp16_pre_scaled_operands_take_a_power_of_two():
    """bf16 holds float32's exponents: its pre-scaled operands need no 2^e, and its source is as it was."""
    half = _src(A(4, "channel", 32), A(4, "token", 32))
    assert "scores_prescaled_e_inv" in half and "pv_prescaled_e0_inv" in half
    assert "scores_scaled = scores_scaled * scores_prescaled_e_inv" in half
    assert "tl.sum(scores_prescaled_c0.to(tl.float32), 1) * scores_prescaled_e_inv" in half
    assert "_prescaled_e" not in _src(A(4, "channel", 32), A(4, "token", 32), dtype=torch.bfloat16)

# -- 64-bit (batch, head) bases --------------------------------------------------------------------------------

def test_source_moves_each_cache_pointer_to_its_batch_and_head_in_int64():
    """b x stride_b passes 2**31 - 1 in a cache over 2**31 elements: each pointer moves to its (batch, head) once,
    in int64, before the token loop; the loop's offsets (token x stride) count from there. The workspace row and
    the query offset are 64-bit too (outside the loop); a paged kernel's page bases were already int64."""
    src = _src(A(4, "token", 32), A(2, "channel", 32))
    for ptr, s in (("K_CODES", "k"), ("V_CODES", "v")):
        assert f"{ptr} += b64 * stride_{s}b + kvh64 * stride_{s}h" in src
    for ptr, s in (("K_SCALE", "k"), ("K_ZERO", "k"), ("V_SCALE", "v"), ("V_ZERO", "v")):
        assert f"{ptr} += b64 * stride_{s}sb + kvh64 * stride_{s}sh" in src
    assert "b64 = b.to(tl.int64)" in src and "k_base = 0" in src and "v_sbase = 0" in src
    assert "ws_row = ((b.to(tl.int64) * NUM_KV_HEADS" in src and "q_row_off = b.to(tl.int64) * stride_qb" in src
    loop = src[src.index("for tile_start"):src.index("ws_row")]
    assert "int64" not in loop and "b64" not in loop
    plain = _src(None, None)
    assert "K_VALUES += b64 * stride_kb + kvh64 * stride_kh" in plain


def test_a_sequence_past_32_bit_token_offsets_is_refused():
    """The token loop's offsets (token x token stride + channel) stay int32: a cache whose (batch, head) slice
    passes 2**31 - 1 elements is refused by name before a launch (meta tensors: nothing allocated)."""
    from foldc.backends.runtime.offsets import INT32_MAX, check_offsets
    from foldc.backends.triton.launch import token_offsets
    tokens = 2**31 // 64 + 16
    k = torch.empty(1, 2, tokens, 64, device="meta", dtype=torch.float16)
    offsets = token_offsets(k, k[:, :, :16], 16)
    assert offsets["k"] == tokens * 64 + 63 > INT32_MAX and offsets["v"] == 16 * 64 + 63
    with pytest.raises(InputError, match=rf"k reaches element offset {tokens * 64 + 63}.*limit {INT32_MAX}"):
        check_offsets("Triton decode kernel", offsets, "split the tokens")
