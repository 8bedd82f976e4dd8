"""The generated Triton kernels on a CUDA GPU (sm_90 / sm_100), asked for with kernel="triton" (on
sm_90 "auto" sends folded plans to the register-operand kernel, tested in test_gluon_gpu.py).
Skipped without a GPU (CI).

Bar: relative L2 against float64 attention over the same dequantized cache is at most 1.10x
the error of plain bf16 attention over those values (foldc.testing.run_case draws fresh random
inputs and poisons ``out=`` with NaN), and every output element is written.
"""
from __future__ import annotations

import pytest
import torch
from _kernel_cases import check_graph_replay, run_with_lens

import foldc
from foldc.errors import InputError, SpecError
from foldc.testing import random_inputs, rel_l2, run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90 or sm_100)")

TOLERANCE = 1.10
A = foldc.Affine
LAYOUTS = [("token", "token"), ("token", "channel"), ("channel", "token"), ("channel", "channel")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _spec(kl, vl, bits, group=128, heads=(32, 8), head_dim=128):
    k = A(bits, kl, group) if kl else None
    v = A(bits, vl, group) if vl else None
    return foldc.AttentionSpec(*heads, head_dim, k, v)


def _check(r, what):
    assert r.unwritten == 0, f"{what}: {r.unwritten} output elements never written"
    assert r.error <= TOLERANCE * r.bf16_error, (
        f"{what}: error {r.error:.3e} > {TOLERANCE} x bf16 attention's {r.bf16_error:.3e}")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("bits", [2, 4], ids=["int2", "int4"])
@pytest.mark.parametrize("kl,vl", LAYOUTS, ids=[f"K-{k}_V-{v}" for k, v in LAYOUTS])
def test_paper_shape(kl, vl, bits, dtype):
    spec = _spec(kl, vl, bits)
    attn = foldc.compile(spec, "auto", kernel="triton")
    seed = 1000 * bits + 10 * LAYOUTS.index((kl, vl)) + (dtype == "bf16")
    _check(run_case(attn, spec, 4, 5003, DTYPES[dtype], "cuda", seed), f"{spec.describe()} {dtype}")


@pytest.mark.parametrize("spec", [
    _spec("token", None, 8),                                            # 8-bit codes: no OR trick in bf16
    _spec(None, "channel", 8),
    _spec(None, None, 2),                                               # plain
    _spec("token", "channel", 2, group=32, heads=(32, 2)),              # dequant (fails break-even)
    _spec("channel", "token", 4, group=64, heads=(64, 4), head_dim=64),
    foldc.AttentionSpec(32, 8, 96, A(4, "token", 96), A(4, "token", 96)),          # head_dim between powers
    foldc.AttentionSpec(16, 4, 80, A(8, "token", 80), A(8, "channel", 64)),        # of two (fp16 queries' kernel)
    foldc.AttentionSpec(32, 8, 96, A(2, "token", 96), A(2, "channel", 32)),        # padded 16-channel chunks
], ids=["int8-token-K", "int8-channel-V", "plain", "dequant", "int4-r16-d64", "int4-d96", "int8-d80", "int2-d96"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_other_plans(spec, dtype):
    attn = foldc.compile(spec, "auto", kernel="triton")
    _check(run_case(attn, spec, 3, 3001, DTYPES[dtype], "cuda", seed=7), f"{spec.describe()} {dtype}")


@pytest.mark.parametrize("kl,vl", [("token", "channel"), ("channel", "token")], ids=["K-token_V-channel",
                                                                                   "K-channel_V-token"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_batch_of_ragged_sequences(kl, vl, dtype):
    """Batch 8 with lengths from 1 token to the full cache, none a multiple of the tile or group."""
    spec = _spec(kl, vl, 2)
    attn = foldc.compile(spec, "auto", kernel="triton")
    lens = [5000, 1, 17, 129, 1001, 2047, 4095, 3333]
    r = run_with_lens(attn, spec, lens, 5000, DTYPES[dtype], "cuda", seed=99)
    assert r.unwritten == 0
    assert r.error <= TOLERANCE * r.bf16_error, (r.error, r.bf16_error)
    for b, n in enumerate(lens):  # one good sequence cannot hide a bad one
        rb = rel_l2(r.out[b], r.ref[b])
        assert rb <= 4 * r.bf16_error, f"sequence {b} (length {n}): relative L2 {rb:.3e}"


def test_forced_splits_agree():
    spec = _spec("token", "token", 2)
    outs = []
    for splits in (1, 4, 37):
        attn = foldc.compile(spec, "auto", kernel="triton", splits=splits)
        r = run_with_lens(attn, spec, [4000, 2500], 4000, torch.float16, "cuda", seed=4)
        assert r.unwritten == 0 and r.error <= TOLERANCE * r.bf16_error, (splits, r.error, r.bf16_error)
        outs.append(r.out.double())
    for other in outs[1:]:
        assert rel_l2(other, outs[0]) <= 1e-3


def test_auto_picks_this_gpu():
    major = torch.cuda.get_device_capability()[0]
    attn = foldc.compile(_spec("token", "token", 2), "auto")
    assert attn.target == {9: "sm_90", 10: "sm_100"}[major]


def test_other_generation_target_refused():
    major = torch.cuda.get_device_capability()[0]
    other = "sm_100" if major == 9 else "sm_90"
    with pytest.raises(SpecError, match=rf"target='{other}' but the GPU has compute capability {major}\.x.*'auto'"):
        foldc.compile(_spec("token", "token", 2), other)


def test_cpu_inputs_refused_on_gpu_target():
    spec = _spec("token", "token", 2)
    attn = foldc.compile(spec, "auto")
    gen = torch.Generator().manual_seed(0)
    q, k, v, lens = random_inputs(spec, 1, 100, torch.bfloat16, "cpu", gen)
    with pytest.raises(InputError, match=r"runs on a CUDA GPU; q is on cpu.*'interpret'"):
        attn(q, k, v)


def test_cuda_graph_capture_with_seq_lens_and_replay_after_the_lengths_change():
    """No host sync in a call: it can be captured once and replayed as lengths grow (decode)."""
    check_graph_replay(foldc.compile(_spec("token", "channel", 2), "auto", kernel="triton"), _spec("token", "channel", 2), seed=7)
