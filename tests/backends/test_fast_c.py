"""foldc's C launcher (foldc/backends/runtime/fast_c.py, launcher.c) against triton's own, on the CPU: both call a
stand-in libcuda that records the launch configuration and every parameter's bytes (tests/backends/stub_cuda.c),
and for the same launch they must give it the same. The real launches run on the H200 (test_gluon_gpu.py)."""
from __future__ import annotations

import random
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foldc.backends.runtime import fast_c

SIZES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8, "fp16": 2,
         "bf16": 2, "fp32": 4, "fp64": 8}
# signatures as a kernel's: tensors first, then integers, floats and constexprs in any order
SIGNATURES = {
    "decode": ["*i32"] * 7 + ["*fp32"] * 7 + ["i32"] * 10 + ["fp32", "i32", "i32", "constexpr", "constexpr"],
    "mixed": ["*fp16", "*bf16", "constexpr", "i1", "i8", "i16", "i64", "u8", "u16", "u32", "u64", "constexpr", "fp16",
              "bf16", "fp64", "i32", "fp32"],
}


@pytest.fixture(scope="module")
def triton_launchers(stub_cuda):
    """triton 3.6's generated launcher for each signature, linked against the stand-in."""
    from triton.backends.nvidia.driver import include_dirs, make_launcher
    from triton.runtime.build import compile_module_from_src

    out = {}
    for name, signature in SIGNATURES.items():
        src = make_launcher({}, {f"a{i}": t for i, t in enumerate(signature)}, None)
        out[name] = compile_module_from_src(src, "__triton_launcher", library_dirs=[str(stub_cuda.path.parent)],
                                            include_dirs=include_dirs, libraries=["libcuda.so.1"]).launch
    return out


def _value(kind: str, rng: random.Random):
    """A random value of a signature type, within what both launchers take."""
    if kind == "constexpr":
        return rng.choice([16, "and.b32", None])
    if kind in ("i1", "u1"):
        return rng.random() < 0.5
    if kind == "i8":
        return rng.randrange(0, 128)
    if kind.startswith(("i", "u")):
        bits = int(kind[1:])
        low = -(1 << (bits - 1)) if kind[0] == "i" else 0
        return rng.randrange(low, low + (1 << bits))
    if kind == "fp16":
        return rng.uniform(-60000.0, 60000.0)
    return rng.uniform(-1e30, 1e30) * rng.choice([1.0, 1e-35])


def _sizes(signature: list[str]) -> list[int]:
    return [8 if t.startswith("*") else SIZES[t] for t in signature if t != "constexpr"] + [8, 8]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1 << 30), name=st.sampled_from(sorted(SIGNATURES)), slot_on=st.booleans())
def test_foldc_and_triton_give_the_driver_the_same_launch(stub_cuda, triton_launchers, seed, name, slot_on):
    """Random values of every type, random 16-byte aligned addresses, a grid, block, shared memory and stream:
    the parameters' bytes and the launch configuration the driver gets are identical, with and without a
    32-bit integer given per call; a second call with new addresses and integer changes only those."""
    stub, rng = stub_cuda, random.Random(seed)
    signature = SIGNATURES[name]
    tensors = sum(t.startswith("*") for t in signature)
    slot = next((i for i, t in enumerate(signature) if t == "i32"), -1) if slot_on else -1
    values = [_value(t, rng) for t in signature]
    grid, warps = (rng.randrange(1, 4096), rng.randrange(1, 64), rng.randrange(1, 8)), rng.choice([1, 4, 8])
    shared = rng.randrange(0, 1 << 17)
    function, stream = rng.randrange(1, 1 << 32), rng.randrange(1, 1 << 32)
    packed, slot_index = fast_c.packed_parameters(signature, tuple(values), tensors, slot)
    launch = fast_c.module().Launch(function, *grid, 32 * warps, shared, False, True, packed, tensors, slot_index)
    stub.record(_sizes(signature))
    total = sum(_sizes(signature))
    for _ in range(2):
        values[:tensors] = [16 * rng.randrange(1, 1 << 40) for _ in range(tensors)]
        if slot >= 0:
            values[slot] = rng.randrange(-(1 << 31), 1 << 31)
        triton_launchers[name](*grid, stream, function, False, True, None, None, (warps, 1, shared), None, None, None,
                               *values)
        theirs = (stub.parameters(total), stub.config())
        per_call = values[slot:slot + 1] if slot >= 0 else []
        assert launch(stream, *values[:tensors], *per_call) is True
        assert (stub.parameters(total), stub.config()) == theirs
    assert stub.config()[:7] == (*grid, 32 * warps, shared, stream % (1 << 32), 1)


def test_a_launch_declines_what_it_was_not_bound_for_and_launches_nothing(stub_cuda):
    stub = stub_cuda
    """False, nothing launched: an address off a 16-byte boundary, a per-call integer outside 32 bits, another
    current CUDA context. A driver error is raised with the driver's message; a wrong argument count is a
    TypeError."""
    signature = ["*fp16", "*fp16", "i32", "i32"]
    packed, slot_index = fast_c.packed_parameters(signature, (0, 0, 7, 9), 2, 3)
    launch = fast_c.module().Launch(5, 2, 1, 1, 128, 0, False, False, packed, 2, slot_index)
    stub.record(_sizes(signature))
    assert launch(3, 32, 64, 11) is True
    assert struct.unpack("<QQii", stub.parameters(24)) == (32, 64, 7, 11)
    before = stub.launches()
    assert launch(3, 32, 72, 11) is False
    assert launch(3, 32, 64, 1 << 31) is False and launch(3, 32, 64, -(1 << 31) - 1) is False
    stub.set_context(1)
    try:
        assert launch(3, 32, 64, 11) is False
    finally:
        stub.set_context(0)
    assert stub.launches() == before
    stub.fail_next(700)
    with pytest.raises(RuntimeError, match="stand-in error"):
        launch(3, 32, 64, 11)
    with pytest.raises(TypeError, match="takes 4 positional arguments"):
        launch(3, 32, 64)
    built = fast_c.module()
    empty = built.Launch(5, 0, 1, 1, 128, 0, False, False, packed, 2, slot_index)
    assert empty(3, 32, 64, 11) is True   # an empty grid: nothing launched, as triton's launcher skips it
    with pytest.raises(RuntimeError, match="was not made"):
        built.Launch.__new__(built.Launch)(3)
    with pytest.raises(ValueError, match="8 bytes each"):
        built.Launch(5, 2, 1, 1, 128, 0, False, False, packed[:-1], 2, slot_index)
    with pytest.raises(ValueError, match="the addresses first"):
        built.Launch(5, 2, 1, 1, 128, 0, False, False, packed, 2, 1)
    assert stub.launches() == before


def test_what_the_c_launcher_cannot_pack_is_refused_before_a_launch_is_made():
    """None (the launch then goes through triton's launcher): a tuple or tensor descriptor in the signature, a
    tensor after a scalar, a per-call integer that is not i32 or is a constexpr, a value outside its type."""
    ok = fast_c.packed_parameters(["*fp16", "i32", "i64"], (0, 5, 6), 1, 1)
    assert ok is not None and ok[1] == 1 and len(ok[0]) == 8 * 5
    assert fast_c.packed_parameters(["*fp16", ("i32", "i32")], (0, (1, 2)), 1, -1) is None
    assert fast_c.packed_parameters(["*fp16", "tensordesc<fp16[16, 16]>"], (0, None), 1, -1) is None
    assert fast_c.packed_parameters(["i32", "*fp16"], (5, 0), 1, -1) is None
    assert fast_c.packed_parameters(["*fp16", "i64"], (0, 5), 1, 1) is None
    assert fast_c.packed_parameters(["*fp16", "constexpr"], (0, 5), 1, 1) is None
    assert fast_c.packed_parameters(["*fp16", "i32"], (0, 1 << 31), 1, -1) is None
    assert fast_c.packed_parameters(["*fp16", "i32"], (0,), 1, -1) is None


def test_bf16_and_fp16_parameters_are_packed_as_triton_packs_them():
    """bf16: the top half of the fp32 value (truncated, as triton's pack_bf16); fp16: IEEE half."""
    for x in (1.0, -2.5, 3.1415926, 1e-3, 65504.0):
        f32 = struct.unpack("<I", struct.pack("<f", x))[0]
        assert fast_c.pack_value("bf16", x)[:2] == struct.pack("<H", f32 >> 16)
        assert fast_c.pack_value("fp16", x)[:2] == struct.pack("<e", x)


def _triton_signature(kernel, args: tuple, kwargs: dict) -> tuple[list, list]:
    """(signature types, every argument's value in the kernel's order) as triton's JITFunction.run specialises
    this launch (its binder for the CUDA backend; CPU tensors stand in for the GPU's)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, CUDABackend)
    bound, specialization, _ = binder(*args, **kwargs)
    return [s[0] for s in specialization], list(bound.values())


def _check_against_triton(stub, signature: list, values: list, slot: int) -> None:
    """foldc's packing of a real kernel's launch gives the stand-in driver what triton's launcher gives it."""
    from triton.backends.nvidia.driver import include_dirs, make_launcher
    from triton.runtime.build import compile_module_from_src

    tensors = sum(1 for v in values if isinstance(v, torch.Tensor))
    assert all(isinstance(v, torch.Tensor) for v in values[:tensors])
    addresses = [16 * (i + 1) << 20 for i in range(tensors)]
    plain = addresses + values[tensors:]
    packed = fast_c.packed_parameters(signature, tuple(plain), tensors, slot)
    assert packed is not None, signature
    launch = fast_c.module().Launch(9, 3, 2, 1, 32, 1024, False, False, packed[0], tensors, packed[1])
    src = make_launcher({}, {f"a{i}": t for i, t in enumerate(signature)}, None)
    theirs = compile_module_from_src(src, "__triton_launcher", library_dirs=[str(stub.path.parent)],
                                     include_dirs=include_dirs, libraries=["libcuda.so.1"]).launch
    sizes = _sizes(signature)
    stub.record(sizes)
    theirs(3, 2, 1, 5, 9, False, False, None, None, (1, 1, 1024), None, None, None, *plain)
    expected = stub.parameters(sum(sizes))
    per_call = [plain[slot]] if slot >= 0 else []
    assert launch(5, *addresses, *per_call) is True
    assert stub.parameters(sum(sizes)) == expected


@pytest.mark.parametrize("layout", ["token:2:128 fp16", "channel:4:64 bf16", "token:8:32 fp16 paged"])
def test_the_decode_and_merge_kernels_real_signatures_pack_as_triton_packs_them(stub_cuda, layout):
    """The register-operand decode kernel and the merge kernel, specialised by triton's own binder for a planned
    launch's arguments (contiguous and paged, fp16 and bf16 queries, the token count given per call): foldc's
    packing gives the driver the bytes triton's launcher gives it."""
    import foldc
    import foldc.testing
    from foldc.backends.gluon import kernel as gluon_kernel
    from foldc.backends.gluon.decode_args import TOKENS_ARG
    from foldc.backends.gluon.launch import GluonAttention
    from foldc.backends.runtime.merge import MERGE_SOURCE, merge_arguments
    from foldc.backends.runtime.modules import load_module

    class _Resident(GluonAttention):
        def resident(self, launch, q_dtype, has_lens, page, device):
            return 12

    text, dtype, *paged = layout.split()
    kind, bits, group = text.split(":")
    enc = foldc.Affine(int(bits), kind, int(group))
    spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
    attn = _Resident(spec)
    q_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    q, k, v, _ = foldc.testing.random_inputs(spec, 2, 256, torch.float16, "cpu", gen)
    q = q.to(q_dtype)
    launch = attn.plan_launch(q_dtype, 2, 256, torch.device("cpu"), k=k, v=v)
    ws, lse = attn._scratch.get(launch, torch.device("cpu"), (2, 32))
    table = (torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 64) if paged else None
    args, kwargs = attn.decode_arguments(launch.options, q, k, v, None, ws, 0.1, launch.per_split, 256, table)
    signature, values = _triton_signature(gluon_kernel.foldc_decode_gluon, args, kwargs)
    _check_against_triton(stub_cuda, signature, values, TOKENS_ARG)
    merge = load_module("import triton\nimport triton.language as tl\n" + MERGE_SOURCE, interpret=False).foldc_merge
    out = torch.empty(2, 32, 128, dtype=q_dtype)
    _, merge_args, merge_kwargs = merge_arguments(*ws, out, lse, 4)
    signature, values = _triton_signature(merge, merge_args, merge_kwargs)
    _check_against_triton(stub_cuda, signature, values, -1)
