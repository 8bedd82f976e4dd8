"""Loading generated kernel modules, the interpreter switch and the SM count: what every backend
needs to run a kernel, written once."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

def cache_dir() -> Path:
    root = os.environ.get("FOLDC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "foldc")
    path = Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


_MISSING = object()
_TWINS: dict[int, tuple] = {}  # id(library function) -> (it, the same function in the other mode)


def _library_twin(obj, interpret: bool):
    """``obj``, a @triton.jit function of triton.language, in the other execution mode; None if
    it already suits ``interpret`` (or is not such a function). Pinned to triton 3.6 internals."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if interpret and isinstance(obj, JITFunction):
        make = lambda: InterpretedFunction(  # noqa: E731
            obj.fn, version=obj.version, do_not_specialize=obj.do_not_specialize,
            do_not_specialize_on_alignment=obj.do_not_specialize_on_alignment, debug=obj.debug,
            noinline=obj.noinline, repr=obj._repr, launch_metadata=obj.launch_metadata)
    elif not interpret and isinstance(obj, InterpretedFunction):
        make = lambda: JITFunction(obj.fn, **obj.kwargs)  # noqa: E731
    else:
        return None
    if id(obj) not in _TWINS:
        _TWINS[id(obj)] = (obj, make())
    return _TWINS[id(obj)][1]


def _index_takes_the_one_element() -> None:
    """Make the interpreter's ``tl.tensor.__index__`` take a scalar's one element; idempotent.

    Triton 3.6's interpreter holds every scalar (a program id, a loaded length, a sum of them) as a
    1-element array, and converts it with ``int(array)`` where Python asks for an index:
    ``range(start, end, BLOCK_N)`` over runtime bounds. NumPy deprecated that conversion in 1.25 and
    refuses it from 2.4 ("only 0-dimensional arrays can be converted to Python scalars", a TypeError
    from every decode kernel's loop; triton-lang/triton#9171). The function that patches tl.tensor
    for each interpreted launch is wrapped so that it sets an ``__index__`` of ``int(data.item())``
    for one element (what the conversion gave before); any other array goes to ``int`` as before.
    The wrapper's own setting is recorded by the launch's scope, so it is undone with triton's.
    Pinned to triton 3.6 internals (``_patch_lang_tensor`` and its scope)."""
    from triton.runtime import interpreter as interp

    patch = interp._patch_lang_tensor
    if getattr(patch, "foldc_index", False):
        return

    def one_element(self):
        data = self.handle.data
        return int(data.item() if data.size == 1 else data)

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", one_element)

    patch_lang_tensor.foldc_index = True
    interp._patch_lang_tensor = patch_lang_tensor


@contextmanager
def interpreter(on: bool):
    """Run Triton in interpreter mode (``on``) or native mode for the duration.

    Triton fixes the mode of its own library functions (tl.sum, tl.max, tl.zeros, ... are
    @triton.jit functions) when triton.language is first imported: a process that imported
    triton with TRITON_INTERPRET unset cannot interpret a kernel that calls them ("Cannot call
    @triton.jit'd outside of the scope of a kernel"), and one that imported it under the
    interpreter cannot compile them natively. And an interpreted call of one of them patches
    triton.language for the interpreter without undoing it. So besides setting the variable,
    swap those functions for twins of the wanted mode, and on exit put back every attribute of
    triton.language that changed. Interpreting, make sure that scalars index under any NumPy
    (`_index_takes_the_one_element`)."""
    old = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    saved = []
    try:
        import triton.language as tl  # a first import happens in the wanted mode

        if on:
            _index_takes_the_one_element()
        if not on and type(tl.standard.sum).__name__ == "JITFunction":
            yield  # native mode, native library: nothing to swap (the fast path of GPU launches)
            return
        holders = [m for n, m in list(sys.modules.items()) if n.startswith("triton.language") and m is not None]
        holders += [tl.tensor, tl.dtype, tl.core.tensor_descriptor_base]
        saved = [(h, dict(vars(h))) for h in holders]
        for holder in holders:
            for name, obj in list(vars(holder).items()):
                twin = _library_twin(obj, on)
                if twin is not None:
                    setattr(holder, name, twin)
        yield
    finally:
        for holder, before in saved:
            now = vars(holder)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(holder, name, value)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def load_module(source: str, interpret: bool):
    """Write ``source`` to the kernel cache and import it (Triton needs a real file)."""
    key = hashlib.sha256((source + str(interpret)).encode()).hexdigest()[:20]
    mod_name = f"foldc_kernel_{key}_{'interp' if interpret else 'native'}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    path = cache_dir() / f"{mod_name}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    with interpreter(interpret):
        spec.loader.exec_module(module)
    sys.modules[mod_name] = module
    return module


_SMS: dict = {}   # CUDA device index -> SM count (get_device_properties costs ~10 us per call)
_ARCH: dict = {}  # CUDA device index -> "sm_90", "sm_100", ...


def with_globals(fn, **names):
    """A copy of the plain function ``fn`` whose global ``names`` are replaced (the callees a kernel compiles),
    with everything a JIT reads from a function: its annotations (they mark the constexpr parameters; a function
    made from the code object alone has none, and a JITFunction would take every constexpr as a runtime
    argument), defaults, closure, module and qualified name."""
    import types

    copy = types.FunctionType(fn.__code__, dict(fn.__globals__, **names), fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__annotations__, copy.__kwdefaults__ = dict(fn.__annotations__), fn.__kwdefaults__
    copy.__module__, copy.__qualname__ = fn.__module__, fn.__qualname__
    return copy


def num_sms(device) -> int:
    """SMs of a CUDA ``device`` (a torch.device or its name), cached; 2 for the CPU's interpreter."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SMS:
            _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return _SMS[index]
    return 2


def device_arch(device) -> str:
    """The architecture name of a CUDA ``device`` ("sm_90" for compute capability 9.0, "sm_100" for 10.0), cached;
    "cpu" for the CPU's interpreter."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ARCH:
        major, minor = torch.cuda.get_device_capability(index)
        _ARCH[index] = f"sm_{major}{minor}"
    return _ARCH[index]
