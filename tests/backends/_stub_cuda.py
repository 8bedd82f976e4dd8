"""A stand-in libcuda for CPU tests of kernel launchers (stub_cuda.c): built once per session, loaded under the
name libcuda.so.1 so that launchers opening that name find it. Never used where a GPU is present."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch


class StubCuda:
    """The loaded stand-in: what its cuLaunchKernelEx was last given."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        self.lib.stub_launches.restype = ctypes.c_long
        self.lib.stub_parameters.restype = ctypes.POINTER(ctypes.c_ubyte)
        self.lib.stub_config.restype = ctypes.POINTER(ctypes.c_uint)

    def record(self, sizes: list[int]) -> None:
        """Record each launch's parameters at these sizes in bytes, in order."""
        self.lib.stub_set_sizes(len(sizes), (ctypes.c_int * len(sizes))(*sizes))

    def launches(self) -> int:
        return self.lib.stub_launches()

    def parameters(self, total: int) -> bytes:
        return ctypes.string_at(self.lib.stub_parameters(), total)

    def config(self) -> tuple[int, ...]:
        """(grid x, y, z, threads, shared bytes, stream, attributes, function) of the last launch."""
        return tuple(self.lib.stub_config()[i] for i in range(8))

    def set_context(self, which: int) -> None:
        self.lib.stub_set_context(which)

    def fail_next(self, code: int) -> None:
        self.lib.stub_fail_next(code)


def build_stub(directory: Path) -> StubCuda:
    """Build and load the stand-in; skips where a GPU's driver is present or no C compiler is."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: its own libcuda serves (tests/backends/test_gluon_gpu.py)")
    cc = shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    from triton.backends.nvidia.driver import include_dirs

    out = directory / "libcuda.so.1"
    subprocess.check_call([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                           *(f"-I{d}" for d in include_dirs), str(Path(__file__).with_name("stub_cuda.c")),
                           "-o", str(out)])
    return StubCuda(out)
