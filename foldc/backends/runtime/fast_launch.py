"""Launching a compiled GPU kernel again without triton's per-call bookkeeping.

`JITFunction.run` binds and specialises every argument (one call into triton per argument), builds
the cache key (the options as a string), checks the globals the kernel read, builds the launch
metadata, and calls the launcher through two Python layers. At batch 1 that host path was most of
an eager decode call on the H200. `FastLaunch` takes triton's ordinary path once per
specialisation and keeps the compiled kernel it returns; later launches are keyed by a cheaper
value that is at least as fine as triton's specialisation (the arguments' types; per integer whether
it is 1, whether 16 divides it and its width; every tensor's dtype and 16-byte alignment; the
keyword arguments; the debug and instrumentation knobs) and go straight to the compiled kernel's C launcher.

Keyword arguments (constexprs and options) are read once per dict object: a caller that launches
with the same dict again must not have changed it in between (foldc's launchers build theirs once
per launch configuration and never change them).

Under the interpreter (a CPU run) the kernel object is not a JITFunction and calls pass straight
through. Pinned to triton 3.6's JITFunction, CompiledKernel and CudaLauncher internals (tested on
the H200, and in CI on a stand-in GPU: tests/backends/test_fast_launch.py).
"""
from __future__ import annotations

import operator

import torch
import triton.runtime
from triton import knobs
from triton.runtime.jit import JITFunction

_SCALARS = (int, bool, float, type(None))
_I32, _I64 = 1 << 31, 1 << 63


def _getter(indices: list[int]):
    """A function returning the tuple of ``args[i]`` for ``indices`` (itemgetter, always a tuple)."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*indices)


def _layout(types: tuple):
    """(tensors, integers) getters for arguments of these types, or None where an argument is of a
    type this key does not cover (those launches take triton's ordinary path)."""
    tensors, integers = [], []
    for i, t in enumerate(types):
        if issubclass(t, torch.Tensor):
            tensors.append(i)
        elif t is int or t is bool:
            integers.append(i)
        elif t not in _SCALARS:   # floats and None specialise by type alone, which the key holds
            return None
    return _getter(tensors), _getter(integers)


class _Ready:
    """A compiled kernel and what its launches repeat: the argument tail after the positional ones
    (constexprs and defaults, in the kernel's order) and, where it applies, the C launcher itself."""

    __slots__ = ("compiled", "tail", "direct", "head")

    def __init__(self, compiled, bound: dict, positional: int):
        self.compiled = compiled
        self.tail = tuple(bound.values())[positional:]
        launcher = getattr(compiled, "run", None)
        raw = getattr(launcher, "launch", None)
        plain = (raw is not None and not getattr(launcher, "global_scratch_size", 1)
                 and not getattr(launcher, "profile_scratch_size", 1))
        # the C launcher's leading arguments, as CudaLauncher.__call__ passes them (no scratch buffers)
        self.direct = raw if plain else None
        self.head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None) if plain else None


class FastLaunch:
    """``FastLaunch(kernel)[grid](*args, **kwargs)`` launches like ``kernel[grid](*args, **kwargs)``.
    Constexprs and options go in ``kwargs``; every launch with a new specialisation (or a debug
    or instrumentation setting changed since) takes triton's ordinary path once."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}     # key -> _Ready
        self._layouts: dict = {}     # argument types -> (tensor getter, integer getter) or None
        self._kwargs = (None, None)  # the last kwargs dict seen and its key (the dict is kept alive)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _key(self, args: tuple, kwargs: dict):
        types = tuple(map(type, args))
        layout = self._layouts.get(types, False)
        if layout is False:
            layout = self._layouts[types] = _layout(types)
        if layout is None:
            return None
        tensors, integers = layout
        if kwargs is self._kwargs[0]:
            kw = self._kwargs[1]
        else:
            try:
                kw = tuple(kwargs.items())
                hash(kw)
            except TypeError:   # an unhashable constexpr: the ordinary path every time
                return None
            self._kwargs = (kwargs, kw)
        # triton's integer specialisation: 1 is a constant, multiples of 16 are marked, then the width
        ints = tuple([1 if v == 1 else (v & 15 == 0, -_I32 <= v < _I32, v < _I64) for v in integers(args)])
        return (torch.cuda.current_device(), types, ints,
                tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in tensors(args)]), kw,
                knobs.runtime.debug, knobs.compilation.instrumentation_mode)

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if not isinstance(self.kernel, JITFunction):   # the interpreter's InterpretedFunction
            self.kernel[grid](*args, **kwargs)
            return
        key = self._key(args, kwargs)
        ready = self.compiled.get(key) if key is not None else None
        if ready is None:
            compiled = self.kernel[grid](*args, **kwargs)    # compiles if needed, launches
            # kept only when the keyword arguments are constexprs and options (their values are in the key;
            # a runtime argument given by keyword would be frozen into the tail) and the compile was not async
            by_keyword = [p for p in self.kernel.params if p.name in kwargs]
            if (key is not None and compiled is not None and not hasattr(compiled, "result")
                    and all(p.is_constexpr for p in by_keyword)):
                binder = self.kernel.device_caches[key[0]][4]
                bound, _, _ = binder(*args, **kwargs)
                self.compiled[key] = _Ready(compiled, bound, len(args))
            return
        g = tuple(grid)
        g = g + (1,) * (3 - len(g))
        device = key[0]
        stream = triton.runtime.driver.active.get_current_stream(device)
        compiled = ready.compiled
        values = args + ready.tail
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if ready.direct is not None and not getattr(enter, "calls", True) and not getattr(leave, "calls", True):
            # no hooks to call: CudaLauncher's C launch, as its __call__ makes it, without the metadata
            ready.direct(g[0], g[1], g[2], stream, compiled.function, *ready.head, compiled.packed_metadata,
                         None, None, None, *values)
            return
        # as CompiledKernel.__getitem__'s runner does, without building a closure per launch
        compiled.run(*g, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(g, stream, *values), enter, leave, *values)
