"""The activation's int8 digits for `benchmarks/gemv_imma.py` (the GEMV at m = 1 on int8 MMA operands), and a check
of them and of that kernel's algebra on the CPU. Not production code.

    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/gemv_imma_digits.py

runs `x_digits` (the interpreter, fp16 and fp32 x with outliers, a zero piece and a tiny one, pieces of 32 to 128
k): every digit within its range and ``|x - u (d0 + d1 / 128 + d2 / 16384)| <= max |x| 2^-20`` per piece; then the
kernel's arithmetic in float64 on those digits (each field of the codes masked in place and biased where it holds bit
7, one product per piece of up to 128 k scaled by ``scale * u / 2^(bits*f)``, the zero times the piece's sum)
against `gemm_reference`, for 2-, 4- and 8-bit codes in k groups of 32 to 256. The kernel's layouts are checked by
its own run on a GPU.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _pow2(e):
    """2^e (float32, exact) for an int32 e from -126 to 127."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def x_digits(X, DIG, U, K, P: tl.constexpr):
    """Piece g (k = g P .. g P + P - 1) of x [K]: digits d0, d1, d2 (int8, DIG [3, K]) against the power of two
    u = 2^(E - 5), E the exponent of max |x| (so |x / u| < 64), and the sum of the values they stand for
    (U [K / P, 2]: u, sum; float32). Every product by a power of two and every residual is exact in float32, so
    ``x - u (d0 + d1 / 128 + d2 / 16384)`` is at most u / 32768 <= max |x| 2^-20."""
    g = tl.program_id(0)
    k = g * P + tl.arange(0, P)
    x = tl.load(X + k).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -90) - 5                        # (zeros and subnormal pieces: units that stay normal)
    d0 = tl.floor(x * _pow2(-e) + 0.5)
    r = x - d0 * _pow2(e)                             # exact (Sterbenz), |r| <= u / 2
    d1 = tl.floor(r * _pow2(7 - e) + 0.5)             # |d1| <= 64
    r = r - d1 * _pow2(e - 7)
    d2 = tl.floor(r * _pow2(14 - e) + 0.5)
    tl.store(DIG + k, d0.to(tl.int8))
    tl.store(DIG + K + k, d1.to(tl.int8))
    tl.store(DIG + 2 * K + k, d2.to(tl.int8))
    s = tl.sum(d0, axis=0) + tl.sum(d1, axis=0) / 128.0 + tl.sum(d2, axis=0) / 16384.0
    u = _pow2(e)
    tl.store(U + 2 * g, u)
    tl.store(U + 2 * g + 1, s * u)


def check_digits(seed: int = 0) -> float:
    """The worst ``|x - x~| / max |x|`` per piece over a few activations; raises if a digit leaves its range or the
    bound fails."""
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for dt in (torch.float16, torch.float32):
        for p in (128, 64, 32):
            k = 1024
            x = torch.randn(k, generator=gen) * 2 + 0.1
            x[torch.randint(0, k, (4,), generator=gen)] *= 40
            x[256:256 + p] = 0
            x[512:512 + p] *= 1e-6
            x = x.to(dt)
            dig, u = torch.empty(3, k, dtype=torch.int8), torch.empty(k // p, 2)
            x_digits[(k // p,)](x, dig, u, k, P=p)
            d = dig.double()
            assert d[0].abs().max() <= 64 and d[1].abs().max() <= 64 and d[2].abs().max() <= 64
            xt = u[:, 0].double().repeat_interleave(p) * (d[0] + d[1] / 128 + d[2] / 16384)
            amax = x.double().abs().reshape(-1, p).amax(1).repeat_interleave(p).clamp_min(1e-300)
            err = ((xt - x.double()).abs() / amax).max().item()
            assert err <= 2.0 ** -20, err
            assert torch.allclose(u[:, 1].double(), xt.reshape(-1, p).sum(1), rtol=1e-6, atol=0)
            worst = max(worst, err)
    return worst


def emulate(seed: int = 1) -> dict:
    """The kernel's arithmetic in float64 on the digits `x_digits` makes, beside `gemm_reference`: relative error
    per case."""
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import gemm_reference, quantize_2d

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for enc, n, k in (("k-group:4:128", 64, 1024), ("k-group:2:128", 48, 2048), ("k-group:8:128", 32, 512),
                      ("k-group:4:256", 32, 1024), ("k-group:4:32", 32, 512), ("k-group:2:64", 32, 1024),
                      ("k-group:8:32", 16, 256)):
        spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
        w = torch.randn(n, k, generator=gen) * 0.05 + 0.01 * torch.randn(n, 1, generator=gen)
        wq = quantize_2d(w, spec.weight)
        bits, group, fields = spec.weight.bits, spec.weight.group_size, 8 // spec.weight.bits
        p = min(group, 128)   # the kernel's piece: one field of a chunk inside one group
        x = torch.randn(k, generator=gen) * 2 + 0.1
        x[torch.randint(0, k, (4,), generator=gen)] *= 40
        x = x.half()
        dig, u = torch.empty(3, k, dtype=torch.int8), torch.empty(k // p, 2)
        x_digits[(k // p,)](x, dig, u, k, P=p)
        codes, row_bytes = wq.codes[0, 0].long(), k // fields   # planar: field f of byte j is k = f * row_bytes + j
        s, z = wq.scale[0, 0].double(), wq.zero[0, 0].double()
        digit_weight = torch.tensor([1, 1 / 128, 1 / 16384], dtype=torch.float64)
        y = torch.zeros(n, dtype=torch.float64)
        for f in range(fields):
            byte = ((1 << bits) - 1) << (bits * f)
            a = codes & byte                                   # code * 2^(bits f) in every byte
            bias = 128 if byte & 0x80 else 0
            if bias:
                a = ((a ^ 0x80) & 0xFF).to(torch.int8).long()  # the signed byte the MMA reads: minus 128
            unit = 2.0 ** (-bits * f)
            for j in range(0, row_bytes, p):
                kk = f * row_bytes + j
                g = kk // group
                prods = a[:, j:j + p] @ dig[:, kk:kk + p].long().T   # the IMMA's int32 sums, one column a digit
                uu, xs = u[kk // p].double()
                y += (prods.double() @ digit_weight) * s[:, g] * uu * unit + (z[:, g] + s[:, g] * bias * unit) * xs
        ref = gemm_reference(x[None].double(), wq)[0].double()
        out[enc] = ((y - ref).norm() / ref.norm()).item()
    return out


if __name__ == "__main__":
    print("digits: worst |x - x~| / max |x| per piece", check_digits(), "(bound 2^-20 =", 2.0 ** -20, ")")
    errs = emulate()
    print("the kernel's arithmetic in float64 against gemm_reference:", errs)
    sys.exit(0 if max(errs.values()) < 1e-5 else 1)
