"""Launching a compiled kernel with one call into the CUDA driver.

triton's C launcher parses each launch's arguments from a Python tuple and calls ``cuLaunchKernelEx``.
`RawLaunch` does the driver's part with ``cuLaunchKernel`` through ctypes: the kernel's parameters
live in one preallocated buffer, one 8-byte slot each, packed per launch by one ``struct`` call, and
the driver gets an array of the slots' addresses made once. A tensor must already be its address
(an integer). The slots follow the compiled kernel's signature as triton's launcher reads it:
constexprs (and integers specialised to 1) take no slot, and two trailing pointers (the global and
profile scratch buffers) are null. Kernels that need what ``cuLaunchKernel`` cannot give (a scratch
buffer, programmatic dependent launch, a cooperative grid, clusters) or have a parameter of a type
this does not pack (bf16 scalars, tuples, tensor descriptors) get no `RawLaunch` (`raw_launch`
returns None) and keep triton's launcher.

libcuda is loaded as a ``PyDLL``: the call keeps the GIL, so two threads launching one kernel cannot
pack its buffer while the driver reads it (the driver copies the parameters before it returns).
Pinned to triton 3.6's CudaLauncher (`backends/nvidia/driver.py`): the slot list is checked against
the parameters of the kernel's PTX entry in tests/backends/test_raw_launch.py.
"""
from __future__ import annotations

import ctypes
import operator
import struct

# struct codes of the scalar types triton's launcher passes, by signature type (little-endian, 8-byte slots)
_CODES = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B", "u16": "H",
          "u32": "I", "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d"}
_INVALID_CONTEXT = 201   # CUDA_ERROR_INVALID_CONTEXT: no current context on this thread (triton's launcher makes one)


def slot_codes(signature: list) -> list[str | None] | None:
    """Per kernel argument in order, the struct code of its parameter slot ("Q" for a pointer) or None
    where it takes none (a constexpr); None for the whole list where a type is one this does not pack."""
    codes = []
    for ty in signature:
        if not isinstance(ty, str):
            return None                       # a tuple argument: flattened by triton, not here
        if ty == "constexpr":
            codes.append(None)
        elif ty.startswith("*"):
            codes.append("Q")
        elif ty in _CODES:
            codes.append(_CODES[ty])
        else:
            return None                       # bf16 scalars, tensor descriptors
    return codes


_driver = None


def _cuda():
    """(cuLaunchKernel, cuGetErrorString) from libcuda, loaded once."""
    global _driver
    if _driver is None:
        lib = ctypes.PyDLL("libcuda.so.1")
        launch = lib.cuLaunchKernel
        launch.restype = ctypes.c_int
        launch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                           ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p]
        error = lib.cuGetErrorString
        error.restype = ctypes.c_int
        error.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver = (launch, error)
    return _driver


class RawLaunch:
    """``raw(grid, stream, values)``: launch the compiled kernel over ``grid`` (three integers) on
    ``stream`` (a raw CUstream) with ``values``, every kernel argument in order (tensors as integer
    addresses, constexprs as given; the constexprs are not read). Returns False, launching nothing,
    where the thread has no current CUDA context (the caller takes triton's launcher, which makes
    one); raises RuntimeError with the driver's message on any other error."""

    __slots__ = ("function", "block", "shared", "pick", "pack", "buffer", "params", "fallback")

    def __init__(self, function: int, num_warps: int, shared: int, codes: list):
        slots = [(i, c) for i, c in enumerate(codes) if c is not None]
        fmt = "<" + "".join(c + "x" * (8 - struct.calcsize("<" + c)) for _, c in slots)
        count = len(slots) + 2                       # + the null global and profile scratch pointers
        self.buffer = ctypes.create_string_buffer(8 * count)
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * count)(*(base + 8 * i for i in range(count)))
        self.pack = struct.Struct(fmt).pack_into
        indices = [i for i, _ in slots]
        if len(indices) == 1:
            only = indices[0]
            self.pick = lambda values: (values[only],)
        else:
            self.pick = operator.itemgetter(*indices) if indices else (lambda values: ())
        self.function, self.block, self.shared = function, 32 * num_warps, shared

    def __call__(self, grid: tuple, stream: int, values: tuple) -> bool:
        self.pack(self.buffer, 0, *self.pick(values))
        launch, error = _cuda()
        status = launch(self.function, grid[0], grid[1], grid[2], self.block, 1, 1, self.shared, stream,
                        self.params, None)
        if status == 0:
            return True
        if status == _INVALID_CONTEXT:
            return False
        message = ctypes.c_char_p()
        error(status, ctypes.byref(message))
        raise RuntimeError(f"cuLaunchKernel failed: {(message.value or b'?').decode()} (CUresult {status})")


def raw_launch(compiled, argument_count: int) -> RawLaunch | None:
    """The `RawLaunch` of a triton CompiledKernel whose launches pass ``argument_count`` values (every
    kernel argument, constexprs included), or None where it needs triton's launcher (module docstring)."""
    runner = getattr(compiled, "run", None)
    metadata = getattr(compiled, "metadata", None)
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if runner is None or metadata is None or not isinstance(signature, dict):
        return None
    plain = (getattr(runner, "global_scratch_size", 1) == 0 and getattr(runner, "profile_scratch_size", 1) == 0
             and not getattr(runner, "launch_cooperative_grid", True) and not getattr(runner, "launch_pdl", True)
             and getattr(metadata, "num_ctas", 1) == 1)
    codes = slot_codes(list(signature.values()))
    if not plain or codes is None or len(codes) != argument_count:
        return None
    return RawLaunch(compiled.function, metadata.num_warps, metadata.shared, codes)
