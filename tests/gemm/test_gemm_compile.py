"""`foldc.compile` of a GemmSpec (foldc/gemm/compile.py): its options and kernel choice are checked by name
on every kernel target before anything is planned or built."""
from __future__ import annotations

import pytest

import foldc
from foldc.errors import SpecError
from foldc.gemm import GemmSpec, parse_gemm_encoding

SPEC = GemmSpec(32, 128, parse_gemm_encoding("k-group:4:64", "weight"), m=2)


@pytest.mark.parametrize("target", ["interpret", "sm_90", "sm_100", "auto"])
@pytest.mark.parametrize("option", ["blockm", "splits", "token_tile", "Block_k"])
def test_unknown_option_names_it(target, option):
    """A mistyped option name raised a TypeError from the Triton launcher's __init__ (or, without a GPU, the
    target's error hid it)."""
    with pytest.raises(SpecError) as info:
        foldc.compile(SPEC, target=target, **{option: 16})
    msg = str(info.value)
    assert f"unknown option(s) ['{option}']" in msg and "block_m" in msg and "gemv_split" in msg, msg


@pytest.mark.parametrize("target", ["interpret", "sm_90", "auto"])
@pytest.mark.parametrize("kernel", ["foo", "Triton", None, True])
def test_unknown_kernel_names_it(target, kernel):
    """Under the interpreter any kernel value but "gluon" was taken and ignored, silently."""
    with pytest.raises(SpecError, match=r"kernel=.* must be one of \('auto', 'gluon', 'triton'\)"):
        foldc.compile(SPEC, target=target, kernel=kernel)


def test_known_options_still_compile():
    kernel = foldc.compile(SPEC, target="interpret", kernel="triton", block_m=16, block_n=32, split_k=1)
    assert kernel.explicit == {"block_m": 16, "block_n": 32, "split_k": 1}
    assert foldc.compile(SPEC, target="interpret", kernel="auto").explicit == {}


@pytest.mark.parametrize("kernel", ["auto", "gluon"])
def test_gpu_callable_names_an_x_that_is_not_a_plain_tensor(kernel):
    """The GPU callable's choice between the GEMV and the Triton kernel called x.dim(): an AffineTensor x for a
    plain-activation spec, or a NumPy array, raised AttributeError. The launcher's checks now say what to pass
    (built without a GPU: the checks run before any launch)."""
    import numpy
    import torch

    from foldc.errors import InputError, InputTypeError
    from foldc.gemm.compile import GemmKernel
    from foldc.gemm.reference import quantize_2d

    gemm = GemmKernel(SPEC, "sm_90", kernel=kernel)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = torch.randn(2, 128, generator=gen) + 0.5
    w = quantize_2d(torch.randn(32, 128, generator=gen), SPEC.weight)
    with pytest.raises(InputTypeError, match="x is an AffineTensor but the spec says x is plain"):
        gemm(quantize_2d(x, parse_gemm_encoding("per-token:8", "activation")), w)
    with pytest.raises(InputError, match=r"got a ndarray, not a torch.Tensor"):
        gemm(numpy.asarray(x.half()), w)
    assert not gemm.uses_gemv(numpy.asarray(x.half()), w)


@pytest.mark.parametrize("weight", ["per-channel:8", "k-group:4:128", "per-channel:8:bf16", "per-channel:8:fp32"])
def test_gemv_takes_no_16_bit_scales_that_start_inside_a_word(weight):
    """The register-operand GEMV copies 16-bit scales and zeros as 32-bit words counted from the tensors' first
    address. A weight sliced from an odd output channel of a layer with an odd number of groups a row (per-channel
    scales: one) starts its scales 2 bytes into a word, with its code rows still 16-byte aligned: the GEMV took it
    (a misaligned copy). Now `takes`/`weight_rows` leave it to the Triton kernel and a direct GEMV call names it;
    fp32 scales, and slices from an even channel, are taken as before (built without a GPU: these checks read
    addresses only)."""
    import torch

    from foldc.encoding import AffineTensor
    from foldc.errors import InputError
    from foldc.gemm.compile import GemmKernel
    from foldc.gemm.reference import quantize_2d

    enc = parse_gemm_encoding(weight, "weight")
    spec = GemmSpec(32, 128, enc)
    gemv = GemmKernel(spec, "sm_90").gemv
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    layer = quantize_2d(torch.randn(40, 128, generator=gen), enc)

    def rows_from(first):
        return AffineTensor(layer.codes[:, :, first:first + 32], layer.scale[:, :, first:first + 32],
                            layer.zero[:, :, first:first + 32], layer.encoding, 128)
    odd, even = rows_from(1), rows_from(2)
    groups = layer.scale.shape[-1]
    assert odd.codes.data_ptr() % 16 == 0 and torch.equal(odd.dequantize(), layer.dequantize()[:, :, 1:33])
    assert gemv.weight_rows(even) is not None
    if enc.scale_dtype == torch.float32 or groups % 2 == 0:
        assert gemv.weight_rows(odd) is not None
        return
    assert odd.scale.data_ptr() % 4 == 2
    assert gemv.weight_rows(odd) is None
    with pytest.raises(InputError, match=r"w.scale and w.zero start 2 and 2 bytes past a 4-byte boundary.*"
                                         r"w.scale.clone\(\) and w.zero.clone\(\)"):
        gemv._check_weight(odd)
    fixed = AffineTensor(odd.codes, odd.scale.clone(), odd.zero.clone(), odd.encoding, 128)
    assert gemv.weight_rows(fixed) is not None


def test_a_direct_call_with_an_x_that_records_gradients_raises_at_backward_rather_than_drop_them():
    """The compiled GEMM has no backward: its output had no grad_fn, so a loss through it trained the rest of a model
    and never this path, silently. Now a backward through it raises by name; under no_grad, or for an x that records
    no gradient, the call is as before (the same values)."""
    import torch

    from foldc.errors import UnsupportedError
    from foldc.gemm.reference import quantize_2d

    spec = GemmSpec(64, 128, parse_gemm_encoding("k-group:4:32", "weight"))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    w = quantize_2d(torch.randn(64, 128, generator=gen), spec.weight)
    x = torch.randn(3, 128, generator=gen).half().requires_grad_()
    gemm = foldc.compile(spec, "interpret")
    y = gemm(x, w)
    assert y.requires_grad
    with pytest.raises(UnsupportedError, match="has no backward.*FoldLinear"):
        y.float().sum().backward()
    with torch.no_grad():
        assert not gemm(x, w).requires_grad
    plain = gemm(x.detach(), w)
    assert not plain.requires_grad and torch.equal(plain, y.detach())
