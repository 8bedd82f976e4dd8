"""FastLaunch off the GPU: under the interpreter it passes every launch to the kernel unchanged and
keeps nothing; on a stand-in GPU (triton's own binder, a fake compiled kernel and driver) it reuses a
kernel exactly when triton would give the arguments the same specialisation. The real launches are
tested on the H200 in test_gluon_gpu.py."""
from __future__ import annotations

import struct

import pytest
import torch

from foldc.backends.runtime import fast_launch
from foldc.backends.runtime.fast_launch import FastLaunch
from foldc.backends.runtime.merge import MERGE_SOURCE, launch_merge
from foldc.backends.runtime.modules import interpreter
from foldc.backends.runtime.modules import load_module


def test_interpreted_kernels_pass_through_and_nothing_is_kept():
    merge = load_module("import triton\nimport triton.language as tl\n" + MERGE_SOURCE, interpret=True).foldc_merge
    gen = torch.Generator().manual_seed(5)
    batch, heads, splits, rows, dim = 2, 2, 5, 8, 32
    ws_m = torch.randn(batch, heads, splits, rows, generator=gen)
    ws_l = torch.rand(batch, heads, splits, rows, generator=gen) + 0.5
    ws_acc = torch.randn(batch, heads, splits, rows, dim, generator=gen)
    outs = []
    for kernel in (merge, FastLaunch(merge)):
        out = torch.full((batch, heads * 4, dim), float("nan"), dtype=torch.float16)
        lse = torch.full((batch, heads * 4), float("nan"))
        with interpreter(True):
            launch_merge(kernel, ws_m, ws_l, ws_acc, out, lse, 4)
        outs.append((out, lse))
        if isinstance(kernel, FastLaunch):
            assert kernel.compiled == {}
    assert not torch.isnan(outs[0][0]).any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


class _Compiled:
    """Stands in for a CompiledKernel: records what its launcher is given."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.launches.append(args)


def _kernel_on_a_fake_gpu(monkeypatch, do_not_specialize=None):
    """A real JITFunction with triton's own binder (the generic backend's specialisation, which the
    CUDA backend keeps), whose ordinary launch path compiles nothing and returns a fresh _Compiled;
    no GPU, no driver."""
    import triton.runtime
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    import triton.language as tl

    def kernel(X, Y, n, m, BLOCK: tl.constexpr, ASM: tl.constexpr):   # never compiled
        pass

    jit = JITFunction(kernel, do_not_specialize=do_not_specialize)
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    jit.device_caches = {0: ({}, {}, None, BaseBackend, binder)}
    ordinary = []

    def run(*args, grid, warmup, **kwargs):
        ordinary.append((grid, args, kwargs))
        return _Compiled()

    monkeypatch.setattr(jit, "run", run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class _Driver:
        class active:
            @staticmethod
            def get_current_stream(device):
                return 7

    monkeypatch.setattr(triton.runtime, "driver", _Driver)
    # the stand-in GPU's tensors live in host memory: the fast path's device check is told otherwise
    monkeypatch.setattr(fast_launch, "_IS_CUDA", lambda t: True)
    return jit, ordinary


def test_a_launch_reuses_its_kernel_only_for_the_same_specialisation(monkeypatch):
    """The first launch of each specialisation takes triton's ordinary path; a repeat goes to that
    kernel's launcher with every argument in the kernel's order (constexprs included) on the
    current stream. New alignment, divisibility by 16, integer width or constexpr: ordinary path."""
    jit, ordinary = _kernel_on_a_fake_gpu(monkeypatch)
    fast = FastLaunch(jit)
    buf = torch.zeros(64, dtype=torch.float16)
    x, y = buf[:16], buf[16:32]
    fast[(4, 2)](x, y, 32, 5, BLOCK=64, ASM="and.b32", num_warps=1)
    assert len(ordinary) == 1 and len(fast.compiled) == 1
    compiled = next(iter(fast.compiled.values())).compiled
    x2 = torch.ones(16, dtype=torch.float16)
    fast[(4, 2)](x2, y, 48, 9, BLOCK=64, ASM="and.b32", num_warps=1)          # same specialisation
    assert len(ordinary) == 1
    (launch,) = compiled.launches
    assert launch[:7] == (4, 2, 1, 7, "function", "metadata", None)
    assert launch[9:] == (x2, y, 48, 9, 64, "and.b32")
    calls = [((buf[1:17], y, 32, 5), {}),                     # a pointer off a 16-byte boundary
             ((x, y, 33, 5), {}),                             # no longer a multiple of 16
             ((x, y.float(), 32, 5), {}),                     # another dtype
             ((x, y, 32, 1), {}),                             # 1 is a constant to triton
             ((x, y, 1 << 33, 5), {}),                        # 64-bit
             ((x, y, 32, 5), {"BLOCK": 32}),                  # another constexpr
             ((x, y, 32, 5), {"num_warps": 4})]               # another option
    for i, (args, change) in enumerate(calls):
        kwargs = {"BLOCK": 64, "ASM": "and.b32", "num_warps": 1, **change}
        fast[(4, 2)](*args, **kwargs)
        assert len(ordinary) == 2 + i, (args, change)
    assert len(fast.compiled) == 1 + len(calls)
    assert len(compiled.launches) == 1


class _Launcher:
    """Stands in for triton 3.6's CudaLauncher: its C ``launch`` and the attributes __call__ reads."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.direct, self.wrapped = [], []

    def launch(self, *args):
        self.direct.append(args)

    def __call__(self, *args):
        self.wrapped.append(args)


def _fast_with_launcher(monkeypatch, do_not_specialize=None):
    """(FastLaunch, its stand-in C launcher, the ordinary launches) on the stand-in GPU, where every
    compiled kernel's ``run`` is the one `_Launcher`."""
    jit, ordinary = _kernel_on_a_fake_gpu(monkeypatch, do_not_specialize)
    launcher = _Launcher()

    class _WithLauncher(_Compiled):
        run = launcher

    monkeypatch.setattr(jit, "run", lambda *a, grid, warmup, **k: ordinary.append(a) or _WithLauncher())
    return FastLaunch(jit), launcher, ordinary


def test_repeat_launches_call_the_c_launcher_unless_a_hook_is_set(monkeypatch):
    """With no launch hooks a repeat goes to the C launcher with CudaLauncher's leading arguments
    (cooperative grid, PDL, no scratch buffers), no metadata and the tensors' addresses; with a hook, through the launcher's
    ``__call__`` with the metadata and the hooks, as triton's runner does. Integer arguments of the
    same specialisation (here 48 and 64) share one kernel."""
    from triton import knobs

    fast, launcher, ordinary = _fast_with_launcher(monkeypatch)
    x = torch.zeros(16, dtype=torch.float16)
    kwargs = dict(BLOCK=64, ASM="and.b32", num_warps=1)
    fast[(3,)](x, x, 32, 5, **kwargs)
    fast[(3,)](x, x, 48, 7, **kwargs)
    assert len(ordinary) == 1 and launcher.wrapped == []
    # the C launcher gets the tensors' addresses (no per-pointer check there)
    assert launcher.direct == [(3, 1, 1, 7, "function", False, True, None, None, "metadata", None, None, None,
                                x.data_ptr(), x.data_ptr(), 48, 7, 64, "and.b32")]
    hook = lambda metadata: None   # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        fast[(3,)](x, x, 64, 7, **kwargs)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(launcher.direct) == 1 and len(ordinary) == 1
    (wrapped,) = launcher.wrapped
    assert wrapped[:6] == (3, 1, 1, 7, "function", "metadata") and wrapped[9:] == (x, x, 64, 7, 64, "and.b32")


def test_a_runtime_argument_given_by_keyword_always_takes_the_ordinary_path(monkeypatch):
    """``m`` is no constexpr: passed by keyword its value would be frozen with the kernel, so such
    launches are never kept."""
    jit, ordinary = _kernel_on_a_fake_gpu(monkeypatch)
    fast = FastLaunch(jit)
    x = torch.zeros(16, dtype=torch.float16)
    for m in (5, 7, 9):
        fast[(1,)](x, x, 32, m=m, BLOCK=64, ASM="and.b32", num_warps=1)
    assert len(ordinary) == 3 and fast.compiled == {}
    assert [call[2]["m"] for call in ordinary] == [5, 7, 9]


def test_tensors_after_the_first_anywhere_in_the_arguments_become_their_addresses(monkeypatch):
    """Tensors that are not a prefix of the arguments are replaced in place, and a repeat launch with
    another tensor of the same dtype and alignment passes that tensor's own address."""
    fast, launcher, ordinary = _fast_with_launcher(monkeypatch)
    kwargs = dict(BLOCK=64, ASM="and.b32", num_warps=1)
    gen = torch.Generator().manual_seed(11)
    first = torch.randn(16, generator=gen).half()
    fast[(2,)](first, 32, first, 5, **kwargs)   # X, n... in another order: X, Y are positions 0 and 2
    for _ in range(3):
        a, b = torch.randn(16, generator=gen).half(), torch.randn(16, generator=gen).half()
        n = 16 * int(torch.randint(1, 100, (1,), generator=gen))
        fast[(2,)](a, n, b, 5, **kwargs)
        assert launcher.direct[-1][13:] == (a.data_ptr(), n, b.data_ptr(), 5, 64, "and.b32")
    assert len(ordinary) == 1 and len(launcher.direct) == 3


def test_a_tensor_off_the_gpu_takes_the_ordinary_path(monkeypatch):
    """The fast path hands the launcher bare addresses, so a host tensor (which triton's pointer
    check refuses by name) must never reach it: every such launch goes the ordinary way."""
    fast, launcher, ordinary = _fast_with_launcher(monkeypatch)
    monkeypatch.setattr(fast_launch, "_IS_CUDA", fast_launch.operator.attrgetter("is_cuda"))   # the real check
    x = torch.zeros(16, dtype=torch.float16)
    for _ in range(3):
        fast[(1,)](x, x, 32, 5, BLOCK=64, ASM="and.b32", num_warps=1)
    assert len(ordinary) == 3 and launcher.direct == []


def test_integer_classes_tell_apart_exactly_what_triton_tells_apart():
    """The key's cheap integer classes are equal for two argument lists exactly when triton's
    specialisation (1, divisibility by 16, 32/64-bit width) of every integer is equal."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    special = st.sampled_from([0, 1, 15, 16, 17, 32, -16, -1, (1 << 31) - 16, 1 << 31, -(1 << 31), -(1 << 31) - 1,
                               (1 << 40) + 16, (1 << 63) - 1, 1 << 63])
    one = st.one_of(special, st.integers(-(1 << 64), 1 << 64))

    @settings(max_examples=400, deadline=None)
    @given(st.integers(1, 6).flatmap(lambda n: st.tuples(st.lists(one, min_size=n, max_size=n),
                                                         st.lists(one, min_size=n, max_size=n))))
    def check(pair):
        a, b = (tuple(x) for x in pair)
        fifteens = (15,) * len(a)
        same_key = fast_launch._int_classes(a, fifteens) == fast_launch._int_classes(b, fifteens)
        same_triton = tuple(map(fast_launch._int_class, a)) == tuple(map(fast_launch._int_class, b))
        assert same_key == same_triton, (a, b)

    check()


def _bindable(monkeypatch, stub_cuda, do_not_specialize=None):
    """`_fast_with_launcher` whose compiled kernel can be bound into foldc's C launcher: an integer function
    handle, triton's metadata tuple and the signature triton compiled it with, over the stand-in libcuda."""
    fast, launcher, ordinary = _fast_with_launcher(monkeypatch, do_not_specialize)
    launcher.num_ctas = 1

    class _Source:
        signature = {"X": "*fp16", "Y": "*fp16", "n": "i32", "m": "i32", "BLOCK": "constexpr", "ASM": "constexpr"}

    class _Bindable(_Compiled):
        function, packed_metadata, src, run = 0x5EED, (1, 1, 4096), _Source, launcher

    monkeypatch.setattr(fast.kernel, "run", lambda *a, grid, warmup, **k: ordinary.append(a) or _Bindable())
    monkeypatch.setattr(fast_launch, "_RAW_STREAM", lambda device: 9)
    monkeypatch.setattr(fast_launch, "_CURRENT_DEVICE", lambda: 0)
    stub_cuda.record([8, 8, 4, 4, 8, 8])
    return fast, launcher, ordinary


def _launched(stub_cuda) -> tuple:
    """(grid, threads, shared bytes, stream, function) and the parameters (X, Y, n, m) the driver last got."""
    return stub_cuda.config()[:6] + stub_cuda.config()[7:], struct.unpack("<QQii", stub_cuda.parameters(24))


def test_a_bound_launch_passes_new_addresses_and_refuses_what_it_was_not_bound_for(monkeypatch, stub_cuda):
    """`FastLaunch.bind` after a launch: the bound launch gives the driver the grid, the current stream and
    the new tensors' addresses with the integers it was bound with; an address off a 16-byte boundary,
    another current device, a launch hook or triton's debug knob turned on since make it launch nothing and say
    so (False). A launch not yet run, or run with a tensor off a 16-byte boundary, cannot be bound."""
    from triton import knobs

    fast, launcher, ordinary = _bindable(monkeypatch, stub_cuda)
    kwargs = dict(BLOCK=64, ASM="and.b32", num_warps=1)
    gen = torch.Generator().manual_seed(3)
    buf = torch.randn(64, generator=gen).half()
    x, y = buf[:16], buf[16:32]
    assert fast.bind((4,), (x, y, 32, 5), kwargs) is None   # nothing compiled for it yet
    fast[(4,)](x, y, 32, 5, **kwargs)
    assert fast.bind((4,), (buf[1:17], y, 32, 5), kwargs) is None   # a tensor off a 16-byte boundary
    bound = fast.bind((4,), (x, y, 32, 5), kwargs)
    assert bound is not None and len(ordinary) == 1
    for _ in range(3):
        a, b = (16 * int(i) for i in torch.randint(1, 1 << 40, (2,), generator=gen))
        assert bound((a, b)) is True
        assert _launched(stub_cuda) == ((4, 1, 1, 32, 4096, 9, 0x5EED), (a, b, 32, 5))
    launches = stub_cuda.launches()
    assert bound((16, 18)) is False                                   # off a 16-byte boundary
    monkeypatch.setattr(fast_launch, "_CURRENT_DEVICE", lambda: 1)
    assert bound((16, 32)) is False                                   # another device
    monkeypatch.setattr(fast_launch, "_CURRENT_DEVICE", lambda: 0)
    hook = lambda metadata: None   # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert bound((16, 32)) is False
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    assert bound((16, 32)) is False
    assert stub_cuda.launches() == launches and launcher.direct == [] and launcher.wrapped == []


def test_a_bound_launch_takes_an_unspecialised_integer_per_call(monkeypatch, stub_cuda):
    """``bind(..., dynamic=(i,))`` for an integer the kernel does not specialise on: the bound launch takes
    its value per call (the other integers stay as bound), refuses a value outside 32 bits, and a
    specialised integer cannot be made dynamic."""
    fast, launcher, ordinary = _bindable(monkeypatch, stub_cuda, do_not_specialize=["n"])
    kwargs = dict(BLOCK=64, ASM="and.b32", num_warps=1)
    buf = torch.zeros(64, dtype=torch.float16)
    x, y = buf[:16], buf[16:32]
    fast[(4,)](x, y, 32, 5, **kwargs)
    with pytest.raises(ValueError, match="argument 3 cannot be given per call"):
        fast.bind((4,), (x, y, 32, 5), kwargs, dynamic=(3,))   # m is specialised on
    bound = fast.bind((4,), (x, y, 32, 5), kwargs, dynamic=(2,))
    gen = torch.Generator().manual_seed(8)
    for n in (int(v) for v in torch.randint(0, 1 << 30, (4,), generator=gen)):
        assert bound((16, 32), (n,)) is True
        assert _launched(stub_cuda)[1] == (16, 32, n, 5)
    launches = stub_cuda.launches()
    assert bound((16, 32), (1 << 31,)) is False and stub_cuda.launches() == launches
    assert len(ordinary) == 1


def test_two_bound_launches_go_behind_one_check(monkeypatch, stub_cuda):
    """`Bound.then` (a decode and its merge): both launch on the current stream with their own addresses (2); a
    second that declines (an address off a 16-byte boundary) leaves the first launched (1); a hook, the debug
    knob or another current device launch nothing (0)."""
    from triton import knobs

    fast, launcher, ordinary = _bindable(monkeypatch, stub_cuda)
    kwargs = dict(BLOCK=64, ASM="and.b32", num_warps=1)
    buf = torch.randn(64, generator=torch.Generator().manual_seed(5)).half()
    x, y = buf[:16], buf[16:32]
    fast[(4,)](x, y, 32, 5, **kwargs)
    first, second = fast.bind((4,), (x, y, 32, 5), kwargs), fast.bind((4,), (x, y, 32, 5), kwargs)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        a, b, c, d = (16 * int(i) for i in torch.randint(1, 1 << 40, (4,), generator=gen))
        before = stub_cuda.launches()
        assert first.then((a, b), (), second, (c, d)) == 2
        assert stub_cuda.launches() == before + 2 and _launched(stub_cuda)[1] == (c, d, 32, 5)
    before = stub_cuda.launches()
    assert first.then((16, 32), (), second, (16, 18)) == 1 and stub_cuda.launches() == before + 1
    assert _launched(stub_cuda)[1] == (16, 32, 32, 5)
    before = stub_cuda.launches()
    monkeypatch.setattr(fast_launch, "_CURRENT_DEVICE", lambda: 1)
    assert first.then((16, 32), (), second, (16, 32)) == 0
    monkeypatch.setattr(fast_launch, "_CURRENT_DEVICE", lambda: 0)
    hook = lambda metadata: None   # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert first.then((16, 32), (), second, (16, 32)) == 0
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    assert first.then((16, 32), (), second, (16, 32)) == 0
    assert stub_cuda.launches() == before and launcher.direct == [] and len(ordinary) == 1
