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
