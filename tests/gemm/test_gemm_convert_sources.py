"""foldc's converters (foldc/gemm/convert.py) against the tools' OWN packing and dequantization code, transcribed
here (minimal equivalents, each citing its repository and file), not against the formats as foldc's authors read
them: no foldc constant (AWQ_ORDER) or helper (tests/_formats.py) is used. Each test packs fresh random integer
codes with the tool's packer, converts them with foldc and requires foldc's weight to equal the tool's
dequantization of the same tensors exactly, in float64. torch's INT4 runs torch's real CPU kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from foldc.gemm.convert import from_awq, from_gptq, from_gptq_act_order, from_hqq, from_int4pack


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _fp16_scales(gen, rows: int, cols: int) -> torch.Tensor:
    return (torch.rand(rows, cols, generator=gen) * 0.02 + 1e-3).half()


def _foldc_weight(weight) -> torch.Tensor:
    return weight.dequantize(torch.float64)[0, 0]


# ---- AWQ: casper-hansen/AutoAWQ -------------------------------------------------------------------------------

def _autoawq_pack(intweight: torch.Tensor, zeros: torch.Tensor):
    """AutoAWQ awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear (4 bits): intweight [k, n] (the codes
    transposed), zeros [groups, n] (awq/quantize/quantizer.py transposes them); field i of word col holds column
    col * 8 + order_map[i]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack(t):
        out = torch.zeros(t.shape[0], t.shape[1] // 8, dtype=torch.int32)
        for col in range(t.shape[1] // 8):
            for i in range(8):
                out[:, col] |= t[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
        return out
    return pack(intweight), pack(zeros)


def _autoawq_dequantize_gemm(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """AutoAWQ awq/utils/packing_utils.py, unpack_awq + reverse_awq_order + dequantize_gemm (bits=4), in float64:
    [k, n]."""
    shifts = torch.arange(0, 32, 4)
    iweight = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweight = iweight.view(iweight.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    reverse = torch.arange(iweight.shape[-1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    iweight, izeros = iweight[:, reverse] & 15, izeros[:, reverse] & 15
    s = scales.to(torch.float64).repeat_interleave(group_size, dim=0)
    return (iweight - izeros.repeat_interleave(group_size, dim=0)).to(torch.float64) * s


@pytest.mark.parametrize("n, k, group", [(64, 256, 128), (32, 128, 32), (48, 512, 64)])
def test_awq_matches_autoawq_packer_and_dequantization(n, k, group):
    gen = torch.Generator().manual_seed(_seed())
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen)
    scales = _fp16_scales(gen, k // group, n)
    qweight, qzeros = _autoawq_pack(codes.T.contiguous(), zeros)
    want = _autoawq_dequantize_gemm(qweight, qzeros, scales, group)          # [k, n]
    assert torch.equal(want, (codes.T - zeros.repeat_interleave(group, 0)).double()
                       * scales.double().repeat_interleave(group, 0))          # the transcriptions agree
    weight, _ = from_awq(qweight, qzeros, scales, group_size=group)
    assert torch.equal(_foldc_weight(weight), want.T)


# ---- GPTQ v1: AutoGPTQ/AutoGPTQ ------------------------------------------------------------------------------

def _autogptq_pack(intweight: np.ndarray, zeros: np.ndarray, bits: int):
    """AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, QuantLinear.pack (bits 2/4/8): intweight [k, n]
    uint32 packed along k, low bits first; zeros [groups, n] stored minus one (``zeros -= 1`` then uint32, so a
    zero of 0 ORs in all ones from its field up), packed along n."""
    per = 32 // bits
    qweight = np.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j] << np.uint32(bits * j)
    stored = (zeros.astype(np.int64) - 1).astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= stored[:, col * per + j] << np.uint32(bits * j)
    return torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32))


def _autogptq_dequantize(qweight, qzeros, scales, bits: int, group_size: int) -> torch.Tensor:
    """AutoGPTQ qlinear_cuda_old.py, QuantLinear.forward without its CUDA kernel (bits 2/4/8), in float64:
    zeros = ((qzeros >> shift) + 1) & maxq (its CUDA, exllama and exllamav2 kernels: ``(z + 1) & 0x0f``),
    weight = scales * (codes - zeros), [k, n]."""
    wf = torch.arange(0, 32, bits, dtype=torch.int32)[None, :]
    small = torch.int16 if bits == 8 else torch.int8
    zeros = torch.bitwise_right_shift(qzeros[:, :, None].expand(-1, -1, 32 // bits), wf[None]).to(small)
    zeros = torch.bitwise_and(zeros + 1, 2**bits - 1).reshape(-1, 1, qzeros.shape[1] * 32 // bits)
    weight = torch.bitwise_right_shift(qweight[:, None, :].expand(-1, 32 // bits, -1), wf[..., None]).to(small)
    weight = torch.bitwise_and(weight, 2**bits - 1).reshape(-1, group_size, qweight.shape[1])
    s = scales.to(torch.float64).reshape(-1, 1, scales.shape[-1])
    return (s * (weight - zeros).to(torch.float64)).reshape(-1, qweight.shape[1])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_v1_matches_autogptq_packer_and_dequantization(bits):
    """Zeros of 0 included: AutoGPTQ stores them as -1, all ones from that field up in the word, and its kernels
    read (stored + 1) mod 2^bits (a zero of 0 read back as 2^bits before this test)."""
    gen = torch.Generator().manual_seed(_seed())
    n, k, group = 64, 256, 64
    codes = torch.randint(0, 2**bits, (n, k), generator=gen)
    zeros = torch.randint(0, 2**bits, (k // group, n), generator=gen)
    zeros[0, torch.randint(0, n, (4,), generator=gen)] = 0
    scales = _fp16_scales(gen, k // group, n)
    qweight, qzeros = _autogptq_pack(codes.T.numpy().astype(np.uint32), zeros.numpy(), bits)
    want = _autogptq_dequantize(qweight, qzeros, scales, bits, group)        # [k, n]
    weight, _ = from_gptq(qweight, qzeros, scales, torch.arange(k, dtype=torch.int32) // group, bits=bits,
                          group_size=group)
    assert torch.equal(_foldc_weight(weight), want.T)


# ---- GPTQ v2 and act-order: ModelCloud/GPTQModel -------------------------------------------------------------

def _gptqmodel_pack(intweight: np.ndarray, zeros: np.ndarray, bits: int):
    """GPTQModel gptqmodel/nn_modules/qlinear/__init__.py, pack_original (bits 2/4/8): qweight[row] |=
    int_weight[row * pack_factor + j] << (bits * j) (along k), qzeros[:, col] |= zeros[:, col * pack_factor + j] <<
    (bits * j) (along n), the zeros as they are (its internal v2 format, also checkpoint_format gptq_v2)."""
    per = 32 // bits
    qweight = np.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=np.int64)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j].astype(np.int64) << (bits * j)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per), dtype=np.int64)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= zeros[:, col * per + j].astype(np.int64) << (bits * j)
    return (torch.from_numpy(qweight.astype(np.uint32).astype(np.int32)),
            torch.from_numpy(qzeros.astype(np.uint32).astype(np.int32)))


def _gptqmodel_dequantize(qweight, qzeros, scales, g_idx, bits: int) -> torch.Tensor:
    """GPTQModel qlinear/__init__.py, dequantize_weight + _dequantize_from_codes (bits 2/4/8, num_itr=1), in
    float64: scales[g_idx] * (weight - zeros[g_idx]), [k, n] in the layer's own input order."""
    per = 32 // bits
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(qzeros[:, :, None].expand(-1, -1, per), wf[None, None, :])
    zeros = torch.bitwise_and(zeros, 2**bits - 1).reshape(scales.shape)
    weight = torch.bitwise_and(torch.bitwise_right_shift(qweight[:, None, :].expand(-1, per, -1), wf[None, :, None]),
                               2**bits - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    g = g_idx.long()
    return scales.to(torch.float64)[g] * (weight - zeros[g]).to(torch.float64)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_v2_matches_gptqmodel_packer_and_dequantization(bits, act_order):
    """With act-order g_idx[c] is input channel c's group, as GPTQ writes it (the groups of a permutation of the
    channels: gptq.py's ``g_idx = [i // group_size for i in range(k)]`` indexed by the inverse permutation)."""
    gen = torch.Generator().manual_seed(_seed())
    n, k, group = 32, 256, 64
    codes = torch.randint(0, 2**bits, (n, k), generator=gen)
    zeros = torch.randint(0, 2**bits, (k // group, n), generator=gen)
    scales = _fp16_scales(gen, k // group, n)
    g_idx = (torch.arange(k) // group).to(torch.int32)
    if act_order:
        g_idx = g_idx[torch.argsort(torch.randperm(k, generator=gen))]
    qweight, qzeros = _gptqmodel_pack(codes.T.numpy(), zeros.numpy(), bits)
    want = _gptqmodel_dequantize(qweight, qzeros, scales, g_idx, bits).T     # [n, k]
    if act_order:
        weight, _, order = from_gptq_act_order(qweight, qzeros, scales, g_idx, bits=bits, group_size=group,
                                               zero_offset=0)
        assert torch.equal(_foldc_weight(weight), want[:, order])
    else:
        weight, _ = from_gptq(qweight, qzeros, scales, g_idx, bits=bits, group_size=group, zero_offset=0)
        assert torch.equal(_foldc_weight(weight), want)


# ---- HQQ: mobiusml/hqq ---------------------------------------------------------------------------------------

def _hqq_quantize_axis1(W: torch.Tensor, nbits: int, group_size: int):
    """hqq/core/quantize.py, Quantizer.quantize with axis=1, optimize=False (BaseQuantizeConfig's default axis): W
    reshaped to [-1, group_size] (consecutive weights of a row), inverse scale max_v / (max - min), zero = -min *
    inverse scale, W_q = round(W * inverse + zero) clamped; meta scale = 1 / inverse. Scale and zero in fp16 (HQQLinear
    casts them to its compute dtype)."""
    Wg = W.float().reshape(-1, group_size)
    lo, hi = Wg.min(axis=1, keepdim=True)[0], Wg.max(axis=1, keepdim=True)[0]
    inv = (2**nbits - 1) / (hi - lo)
    zero = -lo * inv
    W_q = (Wg * inv + zero).round_().clamp_(0, 2**nbits - 1)
    return W_q, (1.0 / inv).half(), zero.half()


def _hqq_pack_unpack_4bit(W_q: torch.Tensor) -> torch.Tensor:
    """hqq/core/bitpack.py, BitPack.pack_4bit_u8 then unpack_4bit_u8: the rows' first half in the high nibbles;
    the unpacked codes are what from_hqq takes."""
    W_q = W_q.to(torch.uint8)
    step = len(W_q) // 2
    packed = (W_q[:step] << 4) | W_q[step:]
    return torch.cat([(packed & 0b11110000) >> 4, packed & 0b00001111])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_hqq_matches_hqq_quantizer_and_dequantization(bits):
    gen = torch.Generator().manual_seed(_seed())
    n, k, group = 48, 256, 64
    W_q, scale, zero = _hqq_quantize_axis1(torch.randn(n, k, generator=gen) * 0.05, bits, group)
    codes = W_q.to(torch.uint8)
    if bits == 4:   # the codes HQQLinear stores packed come back by HQQ's unpacking
        assert torch.equal(_hqq_pack_unpack_4bit(W_q), codes)
    # Quantizer.dequantize: ((W_r - zero) * scale).reshape(shape), in float64
    want = ((codes.to(torch.float64) - zero.to(torch.float64)) * scale.to(torch.float64)).reshape(n, k)
    weight, _ = from_hqq(codes, scale, zero, shape=(n, k), group_size=group, bits=bits)
    assert torch.equal(_foldc_weight(weight), want)


def test_hqq_matches_the_real_hqq_package():
    """HQQ's own Quantizer (pip install hqq): quantize with axis=1, unpack its packed W_q, convert; equal to its
    dequantize in float64. Skipped where hqq is not installed."""
    quantize = pytest.importorskip("hqq.core.quantize")
    gen = torch.Generator().manual_seed(_seed())
    n, k, group = 32, 128, 64
    W = torch.randn(n, k, generator=gen) * 0.05
    W_q, meta = quantize.Quantizer.quantize(W, nbits=4, group_size=group, axis=1, device="cpu",
                                            compute_dtype=torch.float16)
    codes = quantize.Quantizer.unpack[meta["packing"]](W_q, dtype=torch.uint8)
    scale, zero = meta["scale"].half(), meta["zero"].half()
    want = quantize.Quantizer.dequantize(W_q, dict(meta, scale=scale, zero=zero, compute_dtype=torch.float64))
    weight, _ = from_hqq(codes, scale, zero, shape=(n, k), group_size=group, bits=4)
    assert torch.equal(_foldc_weight(weight), want.to(torch.float64))


# ---- torch's tinygemm INT4: pytorch/pytorch, torch's own CPU kernels ------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, group", [(32, 128, 32), (64, 256, 64), (48, 512, 128), (16, 512, 256)])
def test_int4pack_matches_torchs_cpu_kernel(dtype, n, k, group):
    """aten/src/ATen/native/cpu/int4mm_kernel.cpp: _convert_weight_to_int4pack_for_cpu takes int32 codes [n, k]
    in 0..15, _weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros [k / group, n, 2]) dequantizes
    (code - 8) * scale + zero (the CUDA kernel, aten/src/ATen/native/cuda/int4mm.cu, the same from uint8 [n, k / 2]).
    x = the identity gives torch's dequantized weight, rounded to ``dtype`` once: scales and zeros on a 2^-12 grid
    keep (code - 8) * scale + zero exact in float32."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch has no _weight_int4pack_mm_for_cpu")
    gen = torch.Generator().manual_seed(_seed())
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = torch.randint(1, 129, (k // group, n), generator=gen) * 2.0**-12
    zero = torch.randint(-256, 257, (k // group, n), generator=gen) * 2.0**-12
    sz = torch.stack([scale, zero], -1).to(dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    torch_w = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=dtype), packed, group, sz).T
    weight, _ = from_int4pack(codes, sz, group_size=group)
    ours = _foldc_weight(weight)
    assert torch.equal(ours.to(dtype), torch_w)
    x = torch.randn(4, k, generator=gen).to(dtype)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz).double()
    ref = x.double() @ ours.T
    assert float((y - ref).abs().max()) <= 2**-7 * float(ref.abs().max())
