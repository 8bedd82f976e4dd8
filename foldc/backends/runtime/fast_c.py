"""foldc's C launcher of bound launches (launcher.c): the parameters a `fast_launch.Bound` fixes are packed once,
as triton's generated launcher packs them per call, and a call passes only the tensors' addresses and at most one
32-bit integer. Per call it skips what triton's launcher does again each time (a format string parsed over every
argument, the context and scratch handling, releasing the GIL) and Python builds no argument tuple beyond the
addresses. The module is built on first use with triton's compiler helper (gcc or clang, cached in triton's cache
directory, as triton builds its own launchers) and its copy of cuda.h; libcuda.so.1 is opened by name then.

Packing follows triton 3.6's make_launcher (triton/backends/nvidia/driver.py): constexpr parameters are left out,
pointers are 64-bit addresses, integers take their C width, fp16 is IEEE half, bf16 the top half of the fp32
value, fp32 and fp64 as they are; then the two scratch pointers triton appends (0: a bound launch has no scratch).
tests/backends/test_fast_c.py checks the packed parameters and the launch configuration against triton's own
launcher, both calling a stand-in libcuda that records them."""
from __future__ import annotations

import struct
from pathlib import Path

_SOURCE = Path(__file__).with_name("launcher.c")
_FORMATS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B", "u16": "H", "u32": "I",
            "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d"}
_module = None
_failed: Exception | None = None


def module(libcuda: str = "libcuda.so.1"):
    """The built launcher module with libcuda opened, or None where it cannot be built or loaded (no C compiler,
    no libcuda): bound launches then go through triton's launcher. Tried once per process."""
    global _module, _failed
    if _module is None and _failed is None:
        try:
            from triton.backends.nvidia.driver import include_dirs
            from triton.runtime.build import compile_module_from_src

            built = compile_module_from_src(_SOURCE.read_text(), "foldc_launcher", include_dirs=include_dirs)
            built.load(libcuda)
            _module = built
        except Exception as exc:   # a missing compiler or driver: noted, never raised at a launch
            _failed = exc
    return _module


def pack_value(kind: str, value) -> bytes:
    """One parameter's 8-byte cell as triton's launcher would pass it (``kind``: its signature type)."""
    if kind.startswith("*"):
        return struct.pack("<Q", value)
    if kind == "bf16":
        return struct.pack("<f", value)[2:].ljust(8, b"\0")
    return struct.pack("<" + _FORMATS[kind], value).ljust(8, b"\0")


def packed_parameters(signature: list, values: tuple, addresses: int, slot: int) -> tuple[bytes, int] | None:
    """(the packed parameters, the per-call integer's parameter index or -1) of a launch whose first ``addresses``
    values are tensors given per call (packed as 0 here) and whose value at ``slot`` (-1: none) is a 32-bit
    integer given per call; None where the signature holds a type this launcher does not pack (tuples, tensor
    descriptors), a tensor is not among the first, or a value does not fit its type."""
    if len(signature) != len(values):
        return None
    cells, index, slot_index = [], 0, -1
    for position, (kind, value) in enumerate(zip(signature, values)):
        if kind == "constexpr":
            if position < addresses or position == slot:
                return None
            continue
        if not isinstance(kind, str) or not (kind.startswith("*") or kind in _FORMATS or kind == "bf16"):
            return None
        if (position < addresses) != kind.startswith("*"):
            return None
        if position == slot:
            if kind != "i32":
                return None
            slot_index = index
        try:
            cells.append(pack_value(kind, 0 if position < addresses or position == slot else value))
        except (struct.error, OverflowError, TypeError):
            return None
        index += 1
    cells += [bytes(8), bytes(8)]   # triton's global and profile scratch pointers
    return b"".join(cells), slot_index


def make_launch(compiled, grid: tuple, values: tuple, addresses: int, slot: int = -1):
    """A `Launch` of triton's ``compiled`` kernel over ``grid`` with all its arguments ``values`` (the first
    ``addresses`` of them tensors, ``slot``: the per-call integer's position or -1), or None where it cannot be made
    (see `packed_parameters`; the module unavailable; a cluster launch or scratch buffers)."""
    built = module()
    launcher = getattr(compiled, "run", None)
    if built is None or launcher is None or getattr(launcher, "num_ctas", 1) != 1:
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    signature = list(compiled.src.signature.values())
    packed = packed_parameters(signature, values, addresses, slot)
    if packed is None:
        return None
    warps, ctas, shared = compiled.packed_metadata
    if ctas != 1:
        return None
    return built.Launch(compiled.function, grid[0], grid[1], grid[2], 32 * warps, shared,
                        bool(launcher.launch_cooperative_grid), bool(launcher.launch_pdl), packed[0], addresses,
                        packed[1])
