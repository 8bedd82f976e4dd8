"""Launching a compiled GPU kernel again without triton's per-call bookkeeping.

`JITFunction.run` binds and specialises the arguments, builds the cache key (the options as a
string), checks the globals the kernel read, and only then launches. At batch 1 that host path
was most of an eager decode call on the H200 (ninth session: `git show 6178656:docs/perf.md`). `FastLaunch` keeps the
first part, triton's own binder (so a kernel is reused only for arguments that triton itself
would give the same specialisation: dtypes, 16-byte alignment, integer divisibility and width),
and keys the compiled kernel it got from the first, ordinary launch by that specialisation and the
options. Later launches with the same key go straight to the compiled kernel's launcher.

Under the interpreter (a CPU run) the kernel object is not a JITFunction and calls pass straight
through. Pinned to triton 3.6's JITFunction and CompiledKernel internals (tested on the H200, and in
CI on a stand-in GPU: tests/backends/test_fast_launch.py).
"""
from __future__ import annotations

import torch
import triton.runtime
from triton import knobs
from triton.runtime.jit import JITFunction


class FastLaunch:
    """``FastLaunch(kernel)[grid](*args, **kwargs)`` launches like ``kernel[grid](*args, **kwargs)``.
    Constexprs and options go in ``kwargs``; every launch with a new specialisation (or a debug
    or instrumentation setting changed since) takes triton's ordinary path once."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}     # (device, specialisation, options, knobs) -> CompiledKernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if not isinstance(self.kernel, JITFunction):   # the interpreter's InterpretedFunction
            self.kernel[grid](*args, **kwargs)
            return
        device = torch.cuda.current_device()
        binder = self.kernel.device_caches[device][4]
        bound, specialization, options = binder(*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()), knobs.runtime.debug,
               knobs.compilation.instrumentation_mode)
        try:
            compiled = self.compiled.get(key)
        except TypeError:   # an unhashable constexpr: the ordinary path every time
            self.kernel[grid](*args, **kwargs)
            return
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)    # compiles if needed, launches
            if compiled is not None and not hasattr(compiled, "result"):   # not an async compile
                self.compiled[key] = compiled
            return
        grid = tuple(grid) + (1,) * (3 - len(grid))
        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
        stream = triton.runtime.driver.active.get_current_stream(device)
        values = tuple(bound.values())
        # as CompiledKernel.__getitem__'s runner does, without building a closure per launch
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *values), *hooks, *values)
