"""Launching a compiled GPU kernel again without triton's per-call bookkeeping.

`JITFunction.run` binds and specialises every argument (one call into triton per argument), builds
the cache key (the options as a string), checks the globals the kernel read, builds the launch
metadata, and calls the launcher through two Python layers. At batch 1 that host path was most of
an eager decode call on the H200. `FastLaunch` takes triton's ordinary path once per
specialisation and keeps the compiled kernel it returns; later launches are keyed by a cheaper
value that is at least as fine as triton's specialisation (the arguments' types; per integer whether
it is 1, whether 16 divides it and its width; every tensor's dtype and 16-byte alignment; the
keyword arguments; the debug and instrumentation knobs) and go straight to the compiled kernel's C launcher,
given each tensor's address as an integer: the launcher then skips the cuPointerGetAttribute it makes
per tensor (0.3 µs each on the H200's host, 14 tensors per decode launch;
`benchmarks/launch_cost.py`). A launch with a tensor off the GPU takes triton's ordinary path,
which refuses it by name. A launch repeated with everything but its tensors fixed is bound (`FastLaunch.bind`,
`Bound`): its parameters are packed once into foldc's own C launcher (`fast_c`), and a call passes only the
addresses.

Keyword arguments (constexprs and options) are read once per dict object: a caller that launches
with the same dict again must not have changed it in between (foldc's launchers build theirs once
per launch configuration and never change them).

Under the interpreter (a CPU run) the kernel object is not a JITFunction and calls pass straight
through. Pinned to triton 3.6's JITFunction, CompiledKernel and CudaLauncher internals (tested on
the H200, and in CI on a stand-in GPU: tests/backends/test_fast_launch.py).
"""
from __future__ import annotations

import functools
import operator

import torch
import triton.runtime
from triton import knobs
from triton.runtime.jit import JITFunction

from . import fast_c
from .launch import RAW_STREAM

_SCALARS = (int, bool, float, type(None))
_I32, _I64 = 1 << 31, 1 << 63
_DATA_PTR = torch.Tensor.data_ptr
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)   # torch.cuda.current_device's own call
_RAW_STREAM = RAW_STREAM
_DTYPE = operator.attrgetter("dtype")
_IS_CUDA = operator.attrgetter("is_cuda")


def _getter(indices: list[int]):
    """A function returning the tuple of ``args[i]`` for ``indices`` (itemgetter, always a tuple)."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*indices)


def _int_class(v: int):
    """triton's integer specialisation: 1 is a constant, multiples of 16 are marked, then the width
    (the constant's mark is no number: it must not equal the flags of `_int_classes`' short form)."""
    return "one" if v == 1 else (v & 15 == 0, -_I32 <= v < _I32, v < _I64)


def _int_classes(ints: tuple, fifteens: tuple) -> tuple:
    """`_int_class` of each integer. The common case (none is 1, all fit in 32 bits) leaves only
    divisibility by 16, one flag each, computed without a Python call per integer."""
    if not ints or 1 in ints or min(ints) < -_I32 or max(ints) >= _I32:
        return tuple(map(_int_class, ints))
    return tuple(map(operator.not_, map(operator.and_, ints, fifteens)))


class _Layout:
    """Where the tensors and integers of a launch sit, for one tuple of argument types: getters for
    both, and how the C launcher's values are made with each tensor replaced by its address."""

    __slots__ = ("tensors", "integers", "count", "prefix", "positions", "fifteens")

    def __init__(self, tensors: list[int], integers: list[int]):
        self.tensors, self.integers = _getter(tensors), _getter(integers)
        self.fifteens = (15,) * len(integers)
        self.count, self.positions = len(tensors), tuple(tensors)
        self.prefix = tensors == list(range(len(tensors)))   # the tensors come first (foldc's kernels)

    def values(self, args: tuple, addresses: list) -> tuple:
        """``args`` with each tensor replaced by its address."""
        if self.prefix:
            return (*addresses, *args[self.count:])
        out = list(args)
        for i, a in zip(self.positions, addresses):
            out[i] = a
        return tuple(out)


def _layout(types: tuple):
    """The `_Layout` of arguments of these types, or None where an argument is of a type the key
    does not cover (those launches take triton's ordinary path)."""
    tensors, integers = [], []
    for i, t in enumerate(types):
        if issubclass(t, torch.Tensor):
            tensors.append(i)
        elif t is int or t is bool:
            integers.append(i)
        elif t not in _SCALARS:   # floats and None specialise by type alone, which the key holds
            return None
    return _Layout(tensors, integers)


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
        self._layouts: dict = {}     # argument types -> _Layout or None
        self._kwargs = (None, None)  # the last kwargs dict seen and its key (the dict is kept alive)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _prepare(self, args: tuple, kwargs: dict):
        """(key, layout, tensors, addresses), or None where the launch takes the ordinary path every
        time. The key is at least as fine as triton's specialisation; the addresses are read once,
        for the key's alignment and for the C launcher."""
        types = tuple(map(type, args))
        layout = self._layouts.get(types, False)
        if layout is False:
            layout = self._layouts[types] = _layout(types)
        if layout is None:
            return None
        if kwargs is self._kwargs[0]:
            kw = self._kwargs[1]
        else:
            try:
                kw = tuple(kwargs.items())
                hash(kw)
            except TypeError:   # an unhashable constexpr: the ordinary path every time
                return None
            self._kwargs = (kwargs, kw)
        tensors = layout.tensors(args)
        addresses = list(map(_DATA_PTR, tensors))
        ints = _int_classes(layout.integers(args), layout.fifteens)
        aligned = functools.reduce(operator.or_, addresses, 0) & 15 == 0   # all 16-byte aligned: one flag
        key = (torch.cuda.current_device(), types, ints, tuple(map(_DTYPE, tensors)),
               True if aligned else tuple([a & 15 == 0 for a in addresses]), kw,
               knobs.runtime.debug, knobs.compilation.instrumentation_mode)
        return key, layout, tensors, addresses

    def bind(self, grid, args: tuple, kwargs: dict, dynamic: tuple = ()) -> "Bound | None":
        """The `Bound` launch of ``args`` and ``kwargs`` over ``grid``, after `launch` ran them once (it
        compiles), or None where it cannot be bound: the tensors do not come first in the arguments,
        a tensor is off the GPU or not 16-byte aligned, the kernel takes triton's launch path or foldc's C
        launcher cannot pack it (`fast_c`). ``dynamic``: the position of at most one integer argument the
        `Bound` takes per call instead (one the kernel does not specialise on, ``do_not_specialize``; values
        within 32 bits, as at the bind)."""
        if not isinstance(self.kernel, JITFunction):
            return None
        params = self.kernel.params
        for i in dynamic:
            if not (0 <= i < len(args) and type(args[i]) is int and -_I32 <= args[i] < _I32
                    and params[i].do_not_specialize):
                raise ValueError(f"argument {i} cannot be given per call: it must be a 32-bit int the kernel "
                                 "does not specialise on (do_not_specialize)")
        prepared = self._prepare(args, kwargs)
        if prepared is None:
            return None
        key, layout, tensors, addresses = prepared
        ready = self.compiled.get(key)
        if (ready is None or ready.direct is None or not layout.prefix or not all(map(_IS_CUDA, tensors))
                or functools.reduce(operator.or_, addresses, 0) & 15):
            return None
        if len(dynamic) > 1:
            raise ValueError("a bound launch takes at most one integer per call")
        if any(i < layout.count for i in dynamic) or _RAW_STREAM is None:
            return None
        g = tuple(grid)
        slot = dynamic[0] if dynamic else -1
        launch = fast_c.make_launch(ready.compiled, g + (1,) * (3 - len(g)), (0,) * layout.count
                                    + args[layout.count:] + ready.tail, layout.count, slot)
        return None if launch is None else Bound(launch, key[0])

    def _key(self, args: tuple, kwargs: dict):
        """The specialisation key of a launch with these arguments (None: the ordinary path)."""
        prepared = self._prepare(args, kwargs)
        return None if prepared is None else prepared[0]

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if not isinstance(self.kernel, JITFunction):   # the interpreter's InterpretedFunction
            self.kernel[grid](*args, **kwargs)
            return
        prepared = self._prepare(args, kwargs)
        ready = self.compiled.get(prepared[0]) if prepared is not None else None
        # a tensor off the GPU goes the ordinary way, where triton refuses it by name (its address
        # would reach the kernel unchecked here)
        if ready is None or not all(map(_IS_CUDA, prepared[2])):
            compiled = self.kernel[grid](*args, **kwargs)    # compiles if needed, launches
            # kept only when the keyword arguments are constexprs and options (their values are in the key;
            # a runtime argument given by keyword would be frozen into the tail) and the compile was not async
            by_keyword = [p for p in self.kernel.params if p.name in kwargs]
            if (prepared is not None and ready is None and compiled is not None and not hasattr(compiled, "result")
                    and all(p.is_constexpr for p in by_keyword)):
                key = prepared[0]
                binder = self.kernel.device_caches[key[0]][4]
                bound, _, _ = binder(*args, **kwargs)
                self.compiled[key] = _Ready(compiled, bound, len(args))
            return
        key, layout, _, addresses = prepared
        g = tuple(grid)
        g = g + (1,) * (3 - len(g))
        stream = triton.runtime.driver.active.get_current_stream(key[0])
        compiled = ready.compiled
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if ready.direct is not None and not getattr(enter, "calls", True) and not getattr(leave, "calls", True):
            # no hooks to call: CudaLauncher's C launch, as its __call__ makes it, without the metadata, with
            # the tensors' addresses (integers skip its per-pointer cuPointerGetAttribute)
            ready.direct(g[0], g[1], g[2], stream, compiled.function, *ready.head, compiled.packed_metadata,
                         None, None, None, *layout.values(args, addresses), *ready.tail)
            return
        # as CompiledKernel.__getitem__'s runner does, without building a closure per launch
        values = args + ready.tail
        compiled.run(*g, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(g, stream, *values), enter, leave, *values)


class Bound:
    """One launch of a compiled kernel with everything but its tensors fixed: the grid, the arguments
    after the tensors (integers, floats, constexprs) and the specialisation `FastLaunch` keyed them by,
    for 16-byte aligned tensors of the dtypes it was bound with, packed once into foldc's C launcher
    (`fast_c`). ``bound(addresses)`` launches it with the tensors' addresses, in order, and returns True;
    it returns False, launching nothing, where the launch must go through `FastLaunch` instead: an address
    not 16-byte aligned, another current device or CUDA context, a launch hook set, or triton's debug or
    instrumentation knob changed since the bind. The caller keys its `Bound` by what it fixed (the
    integers, the tensors' dtypes): a call with other values needs another. ``slot``: the position (after
    the tensors) of a 32-bit integer given per call, ``bound(addresses, (value,))`` (False for a value
    outside 32 bits)."""

    __slots__ = ("device", "launch", "knobs")

    def __init__(self, launch, device: int):
        self.launch, self.device = launch, device
        self.knobs = (knobs.runtime.debug, knobs.compilation.instrumentation_mode)

    def __call__(self, addresses: tuple, values: tuple = ()) -> bool:
        runtime = knobs.runtime
        if (getattr(runtime.launch_enter_hook, "calls", True) or getattr(runtime.launch_exit_hook, "calls", True)
                or (runtime.debug, knobs.compilation.instrumentation_mode) != self.knobs
                or _CURRENT_DEVICE() != self.device):
            return False
        return self.launch(_RAW_STREAM(self.device), *addresses, *values)

    def then(self, addresses: tuple, values: tuple, second: "Bound", addresses2: tuple) -> int:
        """This launch, then ``second`` (a `Bound` without per-call values, e.g. a decode's merge) on the same
        stream, behind one check of the hooks, knobs and device: 0 where nothing launched (as `__call__`'s False),
        1 where only this one did (``second`` declined: the caller launches it its own way), 2 where both did."""
        runtime = knobs.runtime
        if (getattr(runtime.launch_enter_hook, "calls", True) or getattr(runtime.launch_exit_hook, "calls", True)
                or (runtime.debug, knobs.compilation.instrumentation_mode) != self.knobs
                or _CURRENT_DEVICE() != self.device):
            return 0
        stream = _RAW_STREAM(self.device)
        if not self.launch(stream, *addresses, *values):
            return 0
        if second.device != self.device or second.knobs != self.knobs or not second.launch(stream, *addresses2):
            return 1
        return 2


_KEYWORDS: dict[int, tuple] = {}   # id(launch) -> (launch, its constants as one dict)


def keywords(launch) -> dict:
    """``dict(launch.constants)`` (a launch plan's constexprs and options), one dict object per plan object:
    `FastLaunch` reads a keyword dict it saw before without reading it again. Found by the plan's identity
    (hashing one walks its constants); plans are memoised by their launchers, so the objects live on."""
    held = _KEYWORDS.get(id(launch))
    if held is None or held[0] is not launch:
        if len(_KEYWORDS) >= 4096:
            _KEYWORDS.clear()
        held = _KEYWORDS[id(launch)] = (launch, dict(launch.constants))
    return held[1]


SEEN = "seen"   # `Bindings`: a key launched once (bound at its second launch)


class Bindings:
    """A caller's bound launches by its own key (what fixes the launch: integers, strides, dtypes): a key's
    first launch is noted, its second binds (`FastLaunch.bind`), later ones use the `Bound` launches. Keys are
    kept with the object they were made for (``owner``, e.g. a memoised launch plan), so that a key built from
    ``id(owner)`` never finds another owner's launches; at most ``size`` keys (a growing cache makes a new
    one each step: the first launch of a key costs a dict entry, nothing more)."""

    __slots__ = ("_held", "size")

    def __init__(self, size: int = 256):
        self._held: dict = {}
        self.size = size

    def get(self, key, owner):
        """None (never launched), `SEEN` (launched once), or the tuple of `Bound` launches (empty: they
        cannot be bound)."""
        entry = self._held.get(key)
        return None if entry is None or entry[0] is not owner else entry[1]

    def note(self, key, owner, state, bind) -> None:
        """After an ordinary launch of ``key`` whose `get` was ``state``: note a first launch, or bind at the
        second (``bind()`` returns the `Bound` launches, None for those that cannot be bound)."""
        if state is None:
            if len(self._held) >= self.size:
                self._held.clear()
            self._held[key] = (owner, SEEN)
        elif state is SEEN:
            bounds = tuple(bind())
            self._held[key] = (owner, () if None in bounds else bounds)

    def clear(self) -> None:
        self._held.clear()

    def bound(self) -> list[tuple]:
        """Every key's `Bound` launches (for tests and benchmarks)."""
        return [entry[1] for entry in self._held.values() if type(entry[1]) is tuple and entry[1]]
