"""RawLaunch off the GPU: its parameter slots are the compiled kernel's PTX parameters (a kernel of
every scalar type, specialised and built for sm_90 the way triton's JIT builds it, no GPU), values
land in their slots, and kernels that need triton's launcher get none. Launches on the H200:
tests/backends/test_gluon_gpu.py."""
from __future__ import annotations

import re
import struct
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foldc.backends.runtime.raw_launch import RawLaunch, raw_launch, slot_codes

_PTX_SIZES = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2, "u32": 4, "s32": 4, "b32": 4,
              "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8}


def _jit_build(kernel, args: tuple, constexprs: dict):
    """``kernel`` specialised for ``args`` by the CUDA backend's binder and built for sm_90 from the
    signature the JIT would give it (no GPU: CPU tensors stand in for the pointers)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, CUDABackend)
    bound, specialization, options = binder(*args, **constexprs)
    target = GPUTarget("cuda", 90, 32)
    _, signature, consts, attrs = kernel._pack_args(CUDABackend(target), dict(constexprs), bound, specialization,
                                                    options)
    return triton.compile(ASTSource(kernel, signature, consts, attrs), target=target)


def _ptx_parameter_sizes(ptx: str) -> list[int]:
    entry = re.search(r"\.entry\s+\w+\((.*?)\)", ptx, re.S).group(1)
    return [_PTX_SIZES[m] for m in re.findall(r"\.param\s+\.(\w+)", entry)]


def test_slots_are_the_kernels_ptx_parameters():
    import triton
    import triton.language as tl

    @triton.jit
    def every_type(X, Y, n, m, f, flag, big, small, one, none, B: tl.constexpr):
        i = tl.arange(0, B)
        x = tl.load(X + i * m)
        if flag:
            x = x * f
        tl.store(Y + i + n + big + small + one, x)

    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(64, generator=gen), torch.randn(64, generator=gen).half(), 7, 32, 0.5, True, 1 << 40,
            torch.tensor(3, dtype=torch.int64).item() - 5, 1, None)
    compiled = _jit_build(every_type, args, {"B": 32})
    codes = slot_codes(list(compiled.src.signature.values()))
    assert codes is not None and len(codes) == len(args) + 1
    # the specialised 1, the None and the constexpr take no slot; every other argument takes one of its width
    assert [c is None for c in codes] == [False] * 8 + [True] * 3
    widths = [struct.calcsize("<" + c) for c in codes if c is not None] + [8, 8]   # + the two scratch pointers
    assert widths == _ptx_parameter_sizes(compiled.asm["ptx"])


@pytest.mark.parametrize("signature", [["*fp32", "bf16"], ["*fp32", ("i32", "i32")], ["tensordesc<fp16[16, 16]>"]])
def test_types_it_does_not_pack_leave_the_kernel_to_triton(signature):
    assert slot_codes(signature) is None


def _stand_in(signature: dict, **runner):
    """A CompiledKernel's attributes as raw_launch reads them."""
    fields = dict(global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False)
    fields.update(runner)
    return types.SimpleNamespace(run=types.SimpleNamespace(**fields), function=0,
                                 metadata=types.SimpleNamespace(num_ctas=1, num_warps=4, shared=0),
                                 src=types.SimpleNamespace(signature=signature))


@pytest.mark.parametrize("runner", [dict(global_scratch_size=64), dict(profile_scratch_size=8),
                                    dict(launch_pdl=True), dict(launch_cooperative_grid=True)])
def test_kernels_that_need_tritons_launcher_get_none(runner):
    signature = {"X": "*fp32", "n": "i32", "B": "constexpr"}
    assert raw_launch(_stand_in(signature), 3) is not None
    assert raw_launch(_stand_in(signature, **runner), 3) is None
    assert raw_launch(_stand_in(signature), 2) is None    # a launch passing other arguments than the signature's


_SCALARS = {"*fp16": st.integers(0, 2**64 - 1), "i32": st.integers(-2**31, 2**31 - 1),
            "i64": st.integers(-2**63, 2**63 - 1), "u1": st.booleans(), "u32": st.integers(0, 2**32 - 1),
            "fp32": st.floats(width=32, allow_nan=False), "fp64": st.floats(allow_nan=False),
            "constexpr": st.integers(-5, 5)}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(sorted(_SCALARS)), min_size=1, max_size=24).flatmap(
    lambda sig: st.tuples(st.just(sig), st.tuples(*(_SCALARS[t] for t in sig)))))
def test_each_value_lands_in_its_own_slot(case):
    signature, values = case
    codes = slot_codes(signature)
    raw = RawLaunch(0, 1, 0, codes)
    raw.pack(raw.buffer, 0, *raw.pick(values))
    kept = [(c, v) for c, v in zip(codes, values) if c is not None]
    data = bytes(raw.buffer)
    assert len(raw.params) == len(kept) + 2
    base = raw.params[0]
    for i, (code, value) in enumerate(kept):
        assert raw.params[i] == base + 8 * i
        (got,) = struct.unpack_from("<" + code, data, 8 * i)
        assert got == (struct.unpack("<" + code, struct.pack("<" + code, value))[0])
    assert data[8 * len(kept):] == bytes(16)   # the scratch pointers stay null
