"""`foldc.nn.FoldLinear` (CPU: the float64 plan executor for float32 inputs, Triton's interpreter for
fp16): its output against float64 over the dequantized weight, the plan proved when it is built,
converted weights, the custom op's registration (opcheck) and a torch.compile trace through its fake."""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.encoding import AffineTensor
from foldc.gemm import parse_gemm_encoding
from foldc.errors import InputError, InputTypeError, SpecError
from foldc.nn import FoldLinear


def _reference(layer: FoldLinear, x: torch.Tensor) -> torch.Tensor:
    w = layer.weight.dequantize(torch.float64)[0, 0]
    y = x.double() @ w.T
    return y if layer.bias is None else y + layer.bias.double()


@settings(max_examples=15, deadline=None)
@given(n=st.sampled_from([16, 48, 64]), k=st.sampled_from([128, 256]), enc=st.sampled_from(
       ["k-group:4:128", "k-group:2:64", "k-group:8:32", "per-channel:8", "k-group:4:64:bf16"]),
       bias=st.booleans(), lead=st.sampled_from([(1,), (3,), (2, 5)]), seed=st.integers(0, 2**31 - 1))
def test_fold_linear_is_exact_in_float64_over_its_dequantized_weight(n, k, enc, bias, lead, seed):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    layer = FoldLinear.from_linear(lin, enc)
    assert layer.plan.folds and (layer.in_features, layer.out_features) == (k, n)
    x = torch.randn(*lead, k)
    y = layer(x)
    assert y.shape == (*lead, n) and y.dtype == torch.float32
    want = _reference(layer, x)
    assert float((y.double() - want).abs().max()) <= 1e-6 * float(want.abs().max() + 1)   # float32 output rounding


def test_fp16_inputs_run_the_generated_kernel_within_fp16_rounding():
    torch.manual_seed(1)
    layer = FoldLinear.from_linear(torch.nn.Linear(256, 64), "k-group:4:128")
    x = torch.randn(4, 256).half()
    y = layer(x)
    want = _reference(layer, x)
    rounding = float((want.half().double() - want).norm() / want.norm())
    assert y.dtype == torch.float16 and float((y.double() - want).norm() / want.norm()) < 3 * rounding + 1e-4


def test_a_converted_weight_makes_a_layer_and_its_state_moves_with_it():
    from foldc.gemm.convert import from_hqq

    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (32 * 128 // 64, 64), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(64, 1, generator=gen) * 0.02 + 1e-3).half()
    zero = (torch.rand(64, 1, generator=gen) * 15).half()
    weight, enc = from_hqq(codes, scale, zero, shape=(32, 128), group_size=64)
    layer = FoldLinear(weight, enc, bias=torch.randn(32, generator=gen))
    state = layer.state_dict()
    assert set(state) == {"codes", "scale", "zero", "bias", "_extra_state"}
    x = torch.randn(2, 128, generator=gen)
    want = (x.double() @ ((codes.double() - zero.double()) * scale.double()).reshape(32, 128).T
            + layer.bias.double())
    assert float((layer(x).double() - want).abs().max()) <= 1e-6 * float(want.abs().max())



def test_a_weight_of_views_is_stored_in_the_layout_the_kernels_read():
    from foldc.encoding import AffineTensor
    from foldc.gemm.reference import quantize_2d

    torch.manual_seed(4)
    w = quantize_2d(torch.randn(64, 256) * 0.1, parse_gemm_encoding("k-group:4:32", "weight"))
    cols = [t[0, 0].t().contiguous().t()[None, None] for t in (w.scale, w.zero)]   # column-major views
    layer = FoldLinear(AffineTensor(w.codes, cols[0], cols[1], w.encoding, w.head_dim), "k-group:4:32")
    assert layer.scale.is_contiguous() and layer.zero.is_contiguous()
    for m in (4, 40):   # the generated kernel, then the large-m template
        x = torch.randn(m, 256).half()
        want = _reference(layer, x)
        rounding = float((want.half().double() - want).norm() / want.norm())
        assert float((layer(x).double() - want).norm() / want.norm()) < 3 * rounding + 1e-4


def test_a_weight_computed_under_autograd_is_held_as_the_layers_constants():
    """Scales and zeros that came out of autograd (a checkpoint's scales held as nn.Parameter, converted with grad on)
    were kept as non-leaf buffers of that graph: copy.deepcopy of the layer (or of its model) raised "Only Tensors
    created explicitly by the user (graph leaves) support the deepcopy protocol", and the graph stayed alive."""
    from foldc.gemm.reference import quantize_2d

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    w = quantize_2d(torch.randn(48, 64, generator=gen), parse_gemm_encoding("k-group:4:32", "weight"))
    scale, zero = (torch.nn.Parameter(t.clone()) for t in (w.scale, w.zero))
    layer = FoldLinear(AffineTensor(w.codes, scale * 1, zero * 1, w.encoding, 64), "k-group:4:32",
                       bias=torch.randn(48, generator=gen))
    assert not any(t.requires_grad for t in layer.buffers())
    clone = copy.deepcopy(layer)
    x = torch.randn(3, 64, generator=gen, requires_grad=True)
    assert torch.equal(clone(x), layer(x))
    assert torch.allclose(layer(x).double(), _reference(layer, x), rtol=1e-6, atol=1e-6)
    layer(x).sum().backward()
    assert x.grad is not None and scale.grad is None and zero.grad is None


def test_bad_layers_are_refused_before_any_work():
    with pytest.raises(foldc.SpecError, match="k-group"):
        FoldLinear.from_linear(torch.nn.Linear(128, 16), "per-token:8")
    with pytest.raises(foldc.SpecError, match="does not divide"):
        FoldLinear.from_linear(torch.nn.Linear(96, 16), "k-group:4:64")
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 16), "k-group:4:64")
    with pytest.raises(foldc.InputError, match=r"\[\.\.\., 128\]"):
        layer(torch.randn(2, 64))
    with pytest.raises(foldc.InputTypeError, match="from_linear"):
        FoldLinear(torch.randn(16, 128), "k-group:4:64")


@pytest.mark.parametrize("bias, match", [
    (lambda b: b.to(torch.complex64), r"bias dtype=torch.complex64 must be floating point"),  # imaginary part lost
    (lambda b: b > 0, r"bias dtype=torch.bool must be floating point"),                        # added 1.0 where True
    (lambda b: (b * 100).long(), r"bias dtype=torch.int64 must be floating point"),
    (lambda b: b.to("meta"), r"bias is on meta but the weight is on cpu"),   # added uninitialised memory
    (lambda b: b[None], r"bias must be a \[32\] tensor or None; got torch.Size\(\[1, 32\]\)"),
])
def test_a_bias_the_layer_cannot_add_is_refused_when_it_is_built(bias, match):
    """Each of these biases gave an answer without an error: the output adds the bias cast to x's dtype (a complex one
    lost its imaginary part, a bool one added 1.0), and a bias on the meta device added whatever memory the CPU output
    was given. A floating-point bias of any such dtype is added as it comes."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    weight = FoldLinear.from_linear(torch.nn.Linear(128, 32), "k-group:4:64").weight
    b = torch.randn(32, generator=gen)
    with pytest.raises(InputError, match=match):
        FoldLinear(weight, "k-group:4:64", bias=bias(b))
    x = torch.randn(3, 128, generator=gen)
    for dtype in (torch.float16, torch.float64):
        layer = FoldLinear(weight, "k-group:4:64", bias=b.to(dtype))
        assert torch.allclose(layer(x).double(), _reference(layer, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(3, 32), (2, 3, 32), (1,), ()])
def test_the_ops_bias_is_one_per_output_channel_in_the_real_op_and_its_fake(shape):
    """torch.ops.foldc.linear added any bias that broadcast: a [2, 3, 32] bias made a [2, 3, 32] output where the
    fake said [3, 32] (torch.compile lays out the readers by the fake), a [3, 32] or one-element bias was added as a
    matrix or a constant, silently. Both refuse it now, naming the shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 32), "k-group:4:64")
    args = [torch.randn(3, 128, generator=gen), layer.codes, layer.scale, layer.zero, torch.randn(shape, generator=gen)]
    match = re.escape(f"bias shape={tuple(shape)} but the op adds one bias per output channel: pass a [32] tensor")
    with pytest.raises(InputError, match=match):
        torch.ops.foldc.linear(*args, "k-group:4:64", 32)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in args]
        with pytest.raises(InputError, match="bias shape="):
            torch.ops.foldc.linear(*fakes, "k-group:4:64", 32)


@pytest.mark.parametrize("bad", ["complex bias", "bool bias", "int bias", "bias on meta", "weight on meta"])
def test_the_op_refuses_a_bias_or_weight_it_cannot_add_or_read(bad):
    """The op added any bias cast to x's dtype and read the weight wherever it lay: a complex bias lost its imaginary
    part, a bool one added 1.0 where True, and a bias or weight on the meta device gave a CPU result of uninitialised
    memory (values of 1e20), where FoldLinear refuses each. The real op and its fake refuse them now, by name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 32), "k-group:4:64")
    weight = [layer.codes, layer.scale, layer.zero]
    bias = torch.randn(32, generator=gen)
    if bad == "complex bias":
        bias, match = torch.complex(bias, torch.randn(32, generator=gen)), "bias dtype=torch.complex64 must be floating"
    elif bad == "bool bias":
        bias, match = bias > 0, "bias dtype=torch.bool must be floating"
    elif bad == "int bias":
        bias, match = (bias * 8).to(torch.int64), "bias dtype=torch.int64 must be floating"
    elif bad == "bias on meta":
        bias, match = bias.to("meta"), "bias is on meta but x is on cpu"
    else:
        weight, match = [t.to("meta") for t in weight], "the weight (codes) is on meta but x is on cpu"
    args = [torch.randn(3, 128, generator=gen), *weight, bias]
    with pytest.raises(InputError, match=re.escape(match)):
        torch.ops.foldc.linear(*args, "k-group:4:64", 32)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in args]
        with pytest.raises(InputError, match=re.escape(match)):
            torch.ops.foldc.linear(*fakes, "k-group:4:64", 32)


@pytest.mark.parametrize("text", ["none", "", "plain"])
@pytest.mark.parametrize("m", [0, 3])
def test_the_op_refuses_a_plain_weights_encoding_by_name(text, m):
    """An encoding text that names a plain weight ('none', '': what parse_gemm_encoding reads as no encoding) raised
    AttributeError ('NoneType' object has no attribute 'bits') from inside the op and its fake; a SpecError naming
    the text now."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 32), "k-group:4:64")
    args = [torch.randn(m, 128, generator=gen), layer.codes, layer.scale, layer.zero, None]
    match = f"encoding={text!r} names a plain weight"
    with pytest.raises(SpecError, match=re.escape(match)):
        torch.ops.foldc.linear(*args, text, 32)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
        with pytest.raises(SpecError, match=re.escape(match)):
            torch.ops.foldc.linear(*fakes, text, 32)


@settings(max_examples=12, deadline=None)
@given(m=st.sampled_from([0, 2]), enc=st.sampled_from(["k-group:4:64", "k-group:2:32", "per-channel:8"]),
       wrong=st.sampled_from(["n", "k", "both"]), dtype=st.sampled_from([torch.float32, torch.float16]),
       seed=st.integers(0, 2**31 - 1))
def test_the_op_checks_the_weight_against_out_features_and_k_at_any_number_of_rows(m, enc, wrong, dtype, seed):
    """A call of no rows skipped every check: a wrong out_features came back as a [0, out_features] result and a wrong
    k raised a SpecError about head_dim from the encoding. The real op and its fake name the weight's [n, k] at any m
    now."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(seed)
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 32), enc)
    n, k = (48 if wrong != "k" else 32), (100 if wrong != "n" else 128)
    args = [torch.randn(m, k, generator=gen).to(dtype), layer.codes, layer.scale, layer.zero, None]
    match = re.escape(f"hold a [32, 128] weight ({enc}) but the call has out_features={n} and x [m, {k}]: pass "
                      "out_features=32 and x [m, 128]")
    with pytest.raises(InputError, match=match):
        torch.ops.foldc.linear(*args, enc, n)
    with FakeTensorMode() as mode:
        fakes = [None if t is None else mode.from_tensor(t) for t in args]
        with pytest.raises(InputError, match=match):
            torch.ops.foldc.linear(*fakes, enc, n)
    assert torch.ops.foldc.linear(torch.randn(m, 128, generator=gen).to(dtype), *args[1:], enc, 32).shape == (m, 32)


def test_the_custom_op_passes_opcheck_and_traces_through_torch_compile():
    torch.manual_seed(2)
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 32), "k-group:4:64")
    x = torch.randn(3, 128, requires_grad=True)
    args = (x, layer.codes, layer.scale, layer.zero, layer.bias, layer.encoding.short(), 32)
    torch.library.opcheck(torch.ops.foldc.linear.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))
    model = torch.nn.Sequential(layer, torch.nn.GELU())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), model(x))


@settings(max_examples=10, deadline=None)
@given(enc=st.sampled_from(["k-group:4:128", "k-group:2:64:bf16", "k-group:8:32:fp32", "per-channel:4"]),
       lead=st.sampled_from([(1,), (2, 3)]), order=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_gradients_reach_x_through_the_dequantized_weight(enc, lead, order, seed):
    """``y = x @ W.T + b`` backpropagates ``grad @ W`` into x (gradcheck in float64: the forward is the float64
    executor, the backward W in float64), the weight's buffers get no gradient, and an act-order layer's
    gradient lands on x's own channel order."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    k, n = 128, 48
    layer = FoldLinear.from_linear(torch.nn.Linear(k, n), enc)
    if order:
        layer = FoldLinear(layer.weight, layer.encoding, layer.bias, input_order=torch.randperm(k, generator=gen))
    x = torch.randn(*lead, k, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))
    up = torch.randn(*lead, n, dtype=torch.float64, generator=gen)
    (layer(x) * up).sum().backward()
    w = layer.weight.dequantize(torch.float64)[0, 0]
    want = up @ w
    if order:
        want = torch.zeros_like(want).index_copy(-1, layer.input_order, want)
    assert torch.allclose(x.grad, want, rtol=1e-12, atol=1e-12)
    assert not any(b.requires_grad for b in layer.buffers())


def test_a_lora_adapter_beside_a_quantized_layer_trains():
    """float32 activations (the float64 executor's forward, cast), the backward in float32 in row blocks: the
    gradients of a LoRA pair on the layer's input (``h = x + x A^T B^T``) equal those through the float64
    dequantized weight within float32 rounding; a bias given to the op that requires a gradient gets
    ``grad.sum(0)``."""
    import foldc.nn as fnn

    torch.manual_seed(4)
    k, n, r = 256, 96, 4
    layer = FoldLinear.from_linear(torch.nn.Linear(k, n, bias=False), "k-group:4:64")
    a = torch.nn.Parameter(torch.randn(r, k) * 0.1)
    b = torch.nn.Parameter(torch.randn(k, r) * 0.1)
    x = torch.randn(5, k)
    bias = torch.randn(n, requires_grad=True)
    old = fnn._GRAD_ROWS_VALUES
    fnn._GRAD_ROWS_VALUES = 40 * k   # three row blocks (40, 40, 16)
    try:
        y = torch.ops.foldc.linear(torch.relu(x @ a.T @ b.T + x), layer.codes, layer.scale, layer.zero, bias,
                                   layer.encoding.short(), n)
        y.square().sum().backward()
    finally:
        fnn._GRAD_ROWS_VALUES = old
    w = layer.weight.dequantize(torch.float64)[0, 0]
    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    h = torch.relu(x.double() @ a64.T @ b64.T + x.double())
    (h @ w.T + bias64).square().sum().backward()
    for got, want in ((a.grad, a64.grad), (b.grad, b64.grad), (bias.grad, bias64.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_activations_are_refused_as_nn_linear_refuses_them(dtype):
    """An integer x (token ids passed by mistake) is refused by name, eagerly and when traced; it was multiplied in
    float64 and cast back to its integer dtype, a truncated answer."""
    layer = FoldLinear.from_linear(torch.nn.Linear(64, 32), "k-group:4:32")
    x = torch.ones(3, 64, dtype=dtype)
    with pytest.raises(foldc.InputError, match=f"x dtype={dtype}: FoldLinear takes floating-point activations"):
        layer(x)
    with pytest.raises(Exception, match="FoldLinear takes floating-point activations"):
        torch.compile(layer, backend="aot_eager", fullgraph=True)(x)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_activations_are_refused_naming_the_dtypes_taken(dtype):
    """An fp8 x passed the floating-point check: on the CPU its bias raised NotImplementedError ("add_stub" not
    implemented for 'Float8_e4m3fn') from inside the op; the GPU kernels refuse fp8 by name. Refused by name on
    every path now."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    layer = FoldLinear.from_linear(torch.nn.Linear(64, 32), "k-group:4:32")
    x = (torch.randn(3, 64, generator=gen) + 0.5).to(dtype)
    with pytest.raises(foldc.InputError, match=rf"x dtype={dtype}: FoldLinear takes .*float16, bfloat16, float32"):
        layer(x)


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_sparse_activations_are_refused_by_name(layout):
    """A sparse x raised "reshape is not implemented for sparse tensors" from inside FoldLinear (and an act-order
    layer's gather before it)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    dense = torch.randn(3, 64, generator=gen) * (torch.rand(3, 64, generator=gen) > 0.5)
    x = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    for order in (None, torch.randperm(64, generator=gen)):
        layer = FoldLinear(FoldLinear.from_linear(torch.nn.Linear(64, 32), "k-group:4:32").weight, "k-group:4:32",
                           input_order=order)
        with pytest.raises(foldc.InputError, match=r"x is a torch\.sparse_\w+ tensor.*x\.to_dense\(\)"):
            layer(x)
        assert torch.equal(layer(x.to_dense()), layer(dense))


def test_the_layer_owns_its_gemv_counters_outside_its_state():
    """The GPU GEMV's split-k counters live on the layer (a compiled step's CUDA graph sees them): int32
    zeros, one per 16 output channels, moved by .to(), not saved in the state dict."""
    layer = FoldLinear.from_linear(torch.nn.Linear(64, 40, bias=False), "k-group:4:32")
    assert layer.gemv_counters.dtype == torch.int32 and layer.gemv_counters.shape == (3,)
    assert not layer.gemv_counters.any() and "gemv_counters" not in layer.state_dict()
    assert layer.to(torch.float64).gemv_counters.dtype == torch.int32


class _StandInGemv:
    """Records `run_rows` calls and writes x times a fixed matrix, so that the eager path's plumbing (entry
    per row count, rebuilt when a buffer is replaced, bias, fallback) is testable without a GPU."""

    def __init__(self, n):
        self.n, self.calls = n, []

    def run_rows(self, launch, x, codes, scale, zero, out, counters, workspace=None):
        self.calls.append((launch, codes, counters, workspace))
        out.copy_(x.double().sum(dim=1, keepdim=True).expand(-1, self.n).to(out.dtype))


class _StandInKernel:
    def __init__(self, gemv, takes=True):
        self.gemv, self.takes, self.asked = gemv, takes, 0

    def gemv_for(self, m, dtype, device, w):
        self.asked += 1
        return (self.gemv, _StandInLaunch(m), (w.codes[0, 0], w.scale[0, 0], w.zero[0, 0])) if self.takes else None


@dataclass(frozen=True)
class _StandInLaunch:
    m: int
    grid: tuple = (2, 1)   # two blocks of output channels, one split


def test_an_eager_call_launches_the_gemv_from_the_layer_and_remakes_its_rows_when_a_buffer_changes(monkeypatch):
    import foldc.nn as fnn

    torch.manual_seed(4)
    layer = FoldLinear.from_linear(torch.nn.Linear(64, 32), "k-group:4:32")
    gemv = _StandInGemv(32)
    kernel = _StandInKernel(gemv)
    monkeypatch.setattr(fnn, "_gemm", lambda *args: kernel)
    x = torch.randn(3, 64)
    y = layer._eager_gemv(x)
    assert torch.allclose(y, x.sum(dim=1, keepdim=True) + layer.bias)    # the bias added once
    layer._eager_gemv(torch.randn(3, 64))
    assert kernel.asked == 1 and len(gemv.calls) == 2
    assert gemv.calls[0][2:] == fnn._STREAM_BUFFERS[(-1, 0)][::-1]        # the stream's counters and workspace
    layer._eager_gemv(torch.randn(5, 64))                                  # another row count: its own launch
    assert kernel.asked == 2 and gemv.calls[-1][0] == _StandInLaunch(5)
    layer.codes = layer.codes.clone()                                      # a replaced buffer (e.g. .to())
    layer._eager_gemv(torch.randn(3, 64))
    assert kernel.asked == 3 and gemv.calls[-1][1].data_ptr() == layer.codes.data_ptr()
    kernel.takes = False
    layer.scale = layer.scale.clone()
    assert layer._eager_gemv(torch.randn(3, 64)) is None                   # not the GEMV's: the op runs it
    from foldc.nn import EAGER_ENTRIES

    for m in range(1, 2 * EAGER_ENTRIES):                                  # prompts of many lengths
        layer._eager_gemv(torch.randn(m, 64))
    assert 0 < len(layer._eager) <= EAGER_ENTRIES
    layer.scale = layer.scale.float()                                      # the encoding's scales are fp16
    with pytest.raises(foldc.InputError, match="scale dtype=torch.float32"):
        layer._eager_gemv(torch.randn(3, 64))                              # refused as the op refuses it


def test_traced_calls_take_the_custom_op_and_a_copy_drops_the_eager_launches():
    import copy
    import pickle

    from torch._subclasses.fake_tensor import FakeTensorMode

    from foldc.nn import _traced

    assert not _traced()
    with FakeTensorMode():
        assert _traced()
    layer = FoldLinear.from_linear(torch.nn.Linear(64, 32), "k-group:4:32")
    layer._eager[(1, torch.float16, torch.device("cpu"))] = (None, None, None, (lambda: None, None, None))
    clone = copy.deepcopy(layer)
    assert clone._eager == {} and torch.equal(clone.codes, layer.codes)
    loaded = pickle.loads(pickle.dumps(layer))   # a lambda does not pickle: the launches are left behind
    assert loaded._eager == {} and torch.equal(loaded.codes, layer.codes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the register-operand GEMV)")
@settings(max_examples=12, deadline=None)
@given(m=st.sampled_from([1, 3, 16]), dtype=st.sampled_from([torch.float16, torch.bfloat16]), bias=st.booleans(),
       enc=st.sampled_from(["k-group:4:128", "k-group:2:64", "per-channel:8"]), strided=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_gpu_eager_calls_give_the_custom_ops_answer(m, dtype, bias, enc, strided, seed):
    """The eager path (the GEMV launched from the layer) against the custom op on the same input: the same
    kernel and launch, so the same bits; both within the bar against float64."""
    torch.manual_seed(seed)
    layer = FoldLinear.from_linear(torch.nn.Linear(512, 96, bias=bias), enc).cuda()
    x = torch.randn(512, m, device="cuda", dtype=dtype).t() if strided else \
        torch.randn(m, 512, device="cuda", dtype=dtype)
    y = layer(x)
    assert layer._eager and next(iter(layer._eager.values()))[3] is not None   # the GEMV took it from the layer
    via_op = torch.ops.foldc.linear(x.contiguous(), layer.codes, layer.scale, layer.zero, layer.bias,
                                    layer._encoding_text, 96, layer.gemv_counters)
    assert y.dtype == dtype and torch.equal(y, via_op)
    for _ in range(3):   # bound from the second call: later calls of this shape take the layer's fast path
        x_next = torch.randn(1, m, 512, device="cuda", dtype=dtype)
        y_next = layer(x_next)
        assert y_next.shape == (1, m, 96) and torch.equal(y_next[0], torch.ops.foldc.linear(
            x_next[0], layer.codes, layer.scale, layer.zero, layer.bias, layer._encoding_text, 96,
            layer.gemv_counters))
    want = _reference(layer.cpu(), x.cpu())
    assert float((y.cpu().double() - want).norm() / want.norm()) < 1e-2


class _BoundStandIn:
    """Stands in for a bound GEMV launch: records the addresses it is given, launches if ``ok``."""

    def __init__(self):
        self.calls, self.ok = [], True

    def __call__(self, addresses):
        self.calls.append(addresses)
        return self.ok


class _BindingGemv(_StandInGemv):
    """A stand-in whose launches are bound from the first call, one split (no workspace)."""

    class _Launch:
        grid, m = (2, 1), 1

    def __init__(self, n, split=1):
        super().__init__(n)
        self.bound = _BoundStandIn()
        self.launch = self._Launch()
        self.launch.grid = (2, split)

    def run_rows(self, launch, x, codes, scale, zero, out, counters, workspace=None):
        super().run_rows(launch, x, codes, scale, zero, out, counters, workspace)
        return self.bound


@pytest.mark.parametrize("change", [None, "rows", "strided", "dtype", "grad", "replaced buffer", "dispatch mode",
                                    "declines"])
def test_a_call_shaped_as_the_last_bound_one_goes_straight_to_its_launch(monkeypatch, change):
    """After an eager call whose GEMV launch was bound (one split, no bias), a call of the same shape, strides,
    dtype and device with the layer's buffers unchanged hands the bound launch x's address as it lies (no
    reshape), a new output made in its final shape, the weight's and counters' addresses; anything else (or a
    launch that declines) takes the whole path."""
    import foldc.nn as fnn
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(5)
    layer = FoldLinear.from_linear(torch.nn.Linear(64, 32, bias=False), "k-group:4:32")
    gemv = _BindingGemv(32)
    kernel = _StandInKernel(gemv)
    kernel.gemv_for = lambda m, dtype, device, w: (gemv, gemv.launch, (w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]))
    real = fnn._gemm   # the whole path on the CPU runs the real op's kernel
    monkeypatch.setattr(fnn, "_gemm", lambda n, k, enc, target: kernel if target == "auto" else real(n, k, enc, target))
    x = torch.randn(1, 1, 64)
    layer._eager_gemv(x.reshape(-1, 64), x)   # the whole path's eager call (a GPU call on the CPU)
    assert layer._fast is not None
    whole_calls = len(gemv.calls)
    x2 = torch.randn(1, 1, 64)

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    if change is None:
        y = layer(x2)
        codes, scale, zero = (t.data_ptr() for t in (layer.codes, layer.scale, layer.zero))
        part, counters = (t.data_ptr() for t in fnn._STREAM_BUFFERS[(-1, 0)])   # the stream's (one split: unread)
        assert gemv.bound.calls[-1] == (x2.data_ptr(), codes, scale, zero, y.data_ptr(), part, counters)
        assert y.shape == (1, 1, 32) and y.is_contiguous() and len(gemv.calls) == whole_calls
        return
    calls = len(gemv.bound.calls)
    if change == "rows":
        x2 = torch.randn(2, 1, 64)
    elif change == "strided":
        x2 = torch.randn(1, 64, 2)[:, :, :1].transpose(1, 2)
        assert x2.shape == x.shape and x2.stride() != x.stride()
    elif change == "dtype":
        x2 = x2.double()
    elif change == "grad":
        x2.requires_grad_(True)
    elif change == "replaced buffer":
        layer.codes = layer.codes.clone()
    elif change == "declines":
        gemv.bound.ok = False
    if change == "dispatch mode":
        with Counting():
            y = layer(x2)
    else:
        y = layer(x2)
    want = _reference(layer, x2.detach().double())
    assert torch.allclose(y.detach().double(), want, rtol=1e-3, atol=1e-3)   # the op's answer on the CPU
    assert len(gemv.bound.calls) == calls + (change == "declines")


def _split_layers(monkeypatch, shapes):
    """Layers of (n, split) whose GEMV stands in, bound from the first call."""
    import foldc.nn as fnn

    layers, gemvs = [], []
    for n, split in shapes:
        layer = FoldLinear.from_linear(torch.nn.Linear(64, n, bias=False), "k-group:4:32")
        gemv = _BindingGemv(n, split)
        kernel = _StandInKernel(gemv)
        kernel.gemv_for = (lambda g: lambda m, dtype, device, w: (g, g.launch, (w.codes[0, 0], w.scale[0, 0],
                                                                                 w.zero[0, 0])))(gemv)
        layer._gemm_stand_in = kernel
        layers.append(layer)
        gemvs.append(gemv)
    real = fnn._gemm
    by_n = {layer.out_features: layer._gemm_stand_in for layer in layers}
    monkeypatch.setattr(fnn, "_gemm", lambda n, k, enc, target: by_n[n] if target == "auto" else real(n, k, enc, target))
    return layers, gemvs


def test_split_k_partials_and_counters_are_the_streams(monkeypatch):
    """With split-k, eager calls hand the launch the stream's float32 workspace (split x m x n floats at least) and
    int32 counters (one per block of output channels at least), one pair for every layer on that stream; a layer
    that needs more grows them, and a layer holding the old pair takes the whole path once and then holds the new
    one."""
    import foldc.nn as fnn

    monkeypatch.setattr(fnn, "_STREAM_BUFFERS", {})
    layers, gemvs = _split_layers(monkeypatch, ((32, 3), (48, 4)))
    gemvs[1].launch.grid = (3, 4)
    x = torch.randn(1, 64)
    layers[0]._eager_gemv(x, x)
    ((part, counters),) = fnn._STREAM_BUFFERS.values()
    assert part.dtype == torch.float32 and part.numel() == 3 * 32
    assert counters.dtype == torch.int32 and counters.numel() == 2 and not counters.any()
    layers[0](torch.randn(1, 64))
    assert gemvs[0].bound.calls[-1][5:] == (part.data_ptr(), counters.data_ptr())
    layers[1]._eager_gemv(x, x)   # needs 4 x 48 floats and three counters: both grow
    ((grown, more),) = fnn._STREAM_BUFFERS.values()
    assert grown is not part and grown.numel() == 4 * 48 and more.numel() == 3
    assert gemvs[1].calls[-1][2:] == (more, grown)
    calls = len(gemvs[0].bound.calls)
    layers[0](torch.randn(1, 64))   # holds the old pair: the whole path (the op on the CPU)
    assert len(gemvs[0].bound.calls) == calls
    layers[0]._eager_gemv(x, x)    # a bound GPU call again: now the grown pair
    layers[0](torch.randn(1, 64))
    assert gemvs[0].bound.calls[-1][5:] == (grown.data_ptr(), more.data_ptr())


def test_calls_on_two_streams_never_share_counters_or_partials(monkeypatch):
    """One layer called on two streams (which may run at once): each stream's calls get that stream's workspace
    and counters, on the whole path and on the fast path, and a call on the other stream never takes a fast path
    holding the first stream's (split-k's counters shared by two launches at once would end a block's reduction
    early: a silently wrong answer)."""
    import foldc.nn as fnn

    monkeypatch.setattr(fnn, "_STREAM_BUFFERS", {})
    stream = [11]
    monkeypatch.setattr(fnn, "_stream_of", lambda device: stream[0])
    (layer,), (gemv,) = _split_layers(monkeypatch, ((32, 3),))
    x = torch.randn(1, 64)
    layer._eager_gemv(x, x)
    layer(torch.randn(1, 64))          # stream 11's fast path
    first = fnn._STREAM_BUFFERS[(-1, 11)]
    assert gemv.bound.calls[-1][5:] == tuple(t.data_ptr() for t in first)
    stream[0] = 22
    calls, whole = len(gemv.bound.calls), len(gemv.calls)
    layer(torch.randn(1, 64))          # stream 22: not stream 11's fast path
    assert len(gemv.bound.calls) == calls
    layer._eager_gemv(x, x)            # stream 22's whole path: its own pair
    second = fnn._STREAM_BUFFERS[(-1, 22)]
    assert gemv.calls[-1][2:] == second[::-1] and len(gemv.calls) == whole + 1
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, second))
    layer(torch.randn(1, 64))          # and now stream 22's fast path
    assert gemv.bound.calls[-1][5:] == tuple(t.data_ptr() for t in second)


def test_moving_the_layer_drops_its_eager_entries():
    """``.to()`` and friends replace the buffers: the eager entries and the fast path's, which hold the old ones
    (a layer moved off the GPU would otherwise keep its GPU memory alive), are made again."""
    layer = FoldLinear.from_linear(torch.nn.Linear(64, 32, bias=False), "k-group:4:32")
    layer._eager[(1, torch.float16, torch.device("cpu"))] = (layer.codes, layer.scale, layer.zero, None)
    layer._fast = ("held",)
    moved = layer.to(torch.float64)
    assert moved is layer and layer._eager == {} and layer._fast is None


@pytest.mark.parametrize("scale_dtype", ["fp16", "bf16"])
def test_a_dtype_cast_of_the_model_keeps_the_encodings_scales(scale_dtype):
    """model.half() / .float() / .to(torch.bfloat16) after quantizing: the bias follows the cast, the scale and zero
    keep the encoding's dtype (a cast rounded bf16 scales to fp16, and the first forward refused the layer), and the
    layer still computes x @ W.T + bias over the unchanged weight (float32 x: the float64 reference target)."""
    gen = torch.Generator().manual_seed(21)
    layer = FoldLinear.from_linear(torch.nn.Linear(64, 32), f"k-group:4:32:{scale_dtype}")
    scale, zero = layer.scale.clone(), layer.zero.clone()
    model = torch.nn.Sequential(layer)
    for cast, dtype in ((lambda m: m.half(), torch.float16), (lambda m: m.float(), torch.float32),
                        (lambda m: m.to(torch.bfloat16), torch.bfloat16), (lambda m: m.to(torch.float32), torch.float32)):
        cast(model)
        assert layer.scale.dtype == scale.dtype and torch.equal(layer.scale, scale) and torch.equal(layer.zero, zero)
        assert layer.bias.dtype == dtype
    x = torch.randn(3, 64, generator=gen)
    want = x.double() @ layer.weight.dequantize(torch.float64)[0, 0].T + layer.bias.double()
    assert torch.allclose(layer(x).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_module_type_casts_the_bias_and_keeps_the_codes_order_scales_and_counters(dtype):
    """model.type(torch.float32) (nn.Module.type: every tensor cast, integer ones too) turned the uint8 codes, the int64
    input order and the int32 split-k counters into floats: the first call refused the layer in the attention's terms
    ('codes must be uint8 [batch, kv_heads, tokens, ...]'), and a state dict saved then held float codes. The bias
    follows the cast as nn.Linear's does; the rest keeps its dtype and values."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    layer, _ = _layer_pair("k-group:4:32", gen, order=True)
    before = {name: t.clone() for name, t in layer.named_buffers() if name != "bias"}
    model = torch.nn.Sequential(layer).type(dtype)
    assert model[0] is layer and layer.bias.dtype == dtype
    for name, t in layer.named_buffers():
        if name != "bias":
            assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    x = torch.randn(3, 128, generator=gen, dtype=torch.float64)
    want = _reference(layer, x[:, layer.input_order])
    assert torch.allclose(layer(x).double(), want, rtol=1e-6, atol=1e-6)


def test_an_input_order_gathers_x_first_and_moves_with_the_layers_state():
    """FoldLinear(..., input_order=p) computes x[..., p] @ W.T + bias (act-order checkpoints): fp16 through
    Triton's interpreter and float32 through the float64 executor; the order is a buffer of the state dict."""
    from foldc.gemm.reference import quantize_2d

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    n, k = 32, 256
    enc = parse_gemm_encoding("k-group:4:64", "weight")
    weight = quantize_2d(torch.randn(n, k, generator=gen) * 0.05, enc)
    order = torch.randperm(k, generator=gen)
    layer = FoldLinear(weight, enc, bias=torch.randn(n, generator=gen), input_order=order.to(torch.int32))
    assert layer.input_order.dtype == torch.int64 and set(layer.state_dict()) == {"codes", "scale", "zero", "bias",
                                                                                  "input_order", "_extra_state"}
    w = weight.dequantize(torch.float64)[0, 0]
    for x in (torch.randn(2, 3, k, generator=gen), torch.randn(4, k, generator=gen).half()):
        want = x.double()[..., order] @ w.T + layer.bias.double()
        got = layer(x).double()
        assert got.shape == (*x.shape[:-1], n)
        tol = 1e-6 if x.dtype == torch.float32 else 3e-3
        assert float((got - want).norm() / want.norm()) < tol
    copy = FoldLinear(weight, enc, bias=torch.zeros(n), input_order=torch.arange(k))
    copy.load_state_dict(layer.state_dict())
    assert torch.equal(copy.input_order, layer.input_order)


@pytest.mark.parametrize("order, error, match", [
    (torch.arange(255), InputError, r"integer tensor \[256\]"),
    (torch.arange(256).float(), InputError, "integer tensor"),
    (torch.zeros(256, dtype=torch.int64), InputError, "not a permutation"),
    (list(range(256)), InputTypeError, "permutation of the input channels"),
])
def test_an_input_order_that_is_no_permutation_is_refused(order, error, match):
    from foldc.gemm.reference import quantize_2d

    enc = parse_gemm_encoding("k-group:4:64", "weight")
    weight = quantize_2d(torch.randn(16, 256) * 0.05, enc)
    with pytest.raises(error, match=match):
        FoldLinear(weight, enc, input_order=order)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the register-operand GEMV)")
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_calls_with_an_input_order_give_the_ops_answer_over_the_gathered_x(m):
    """An act-order layer on the GPU: the eager GEMV path (and its fast path, from the second call) gives the
    custom op's bits over x gathered by the order, within the bar against float64."""
    from foldc.gemm.reference import quantize_2d

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    enc = parse_gemm_encoding("k-group:4:128", "weight")
    order = torch.randperm(512, generator=gen)
    layer = FoldLinear(quantize_2d(torch.randn(96, 512, generator=gen) * 0.05, enc), enc, input_order=order).cuda()
    for _ in range(3):
        x = torch.randn(m, 512, generator=gen).half().cuda()
        y = layer(x)
        via_op = torch.ops.foldc.linear(x[:, order.cuda()].contiguous(), layer.codes, layer.scale, layer.zero, None,
                                        layer._encoding_text, 96, layer.gemv_counters)
        assert torch.equal(y, via_op)
    want = x.cpu().double()[:, order] @ layer.weight.dequantize(torch.float64)[0, 0].cpu().T
    assert float((y.cpu().double() - want).norm() / want.norm()) < 1e-2


def test_a_layer_built_on_the_meta_device_takes_to_empty_and_a_load():
    """A serving engine builds its model on the meta device, then ``to_empty(device=...)`` and loads the weights:
    the layer's own ``_apply`` copied the meta scale and zero (NotImplementedError: no data), and its split-k
    counters must come out zero (``to_empty`` leaves memory uninitialised; the GEMV needs zeros between calls)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    lin = torch.nn.Linear(128, 48)
    torch.nn.init.normal_(lin.weight, generator=gen)
    torch.nn.init.normal_(lin.bias, generator=gen)
    source = FoldLinear.from_linear(lin, "k-group:4:64:bf16")
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 48), "k-group:4:64:bf16").to("meta")
    assert layer.codes.is_meta and layer.scale.dtype == torch.bfloat16
    layer.to_empty(device="cpu")
    assert layer.scale.device.type == "cpu" and layer.scale.dtype == torch.bfloat16 and layer.bias.dtype == torch.float32
    assert layer.gemv_counters.dtype == torch.int32 and not layer.gemv_counters.any()
    layer.load_state_dict(source.state_dict())
    x = torch.randn(3, 128, generator=gen)
    assert torch.allclose(layer(x).double(), _reference(source, x), rtol=1e-6, atol=1e-6)



def test_an_act_order_layer_built_on_the_meta_device_takes_to_empty_and_a_load():
    """A serving engine builds an act-order layer on the meta device (its input order a placeholder there too), then
    ``to_empty`` and a load: the order's permutation check ran torch.equal on meta tensors, a NotImplementedError
    from inside torch. The placeholder is taken; the loaded order is checked and gathers x."""
    from foldc.gemm.reference import quantize_2d

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    enc = parse_gemm_encoding("k-group:4:64", "weight")
    source = FoldLinear(quantize_2d(torch.randn(48, 128, generator=gen) * 0.1, enc), enc,
                        bias=torch.randn(48, generator=gen), input_order=torch.randperm(128, generator=gen))
    with torch.device("meta"):
        placeholder = AffineTensor(torch.empty(1, 1, 48, 64, dtype=torch.uint8), torch.empty(1, 1, 48, 2).half(),
                                   torch.empty(1, 1, 48, 2).half(), enc.affine(128), 128)
        layer = FoldLinear(placeholder, enc, torch.empty(48), input_order=torch.empty(128, dtype=torch.int64))
    assert layer.input_order.is_meta
    layer.to_empty(device="cpu")
    layer.load_state_dict(source.state_dict())
    assert torch.equal(layer.input_order, source.input_order)
    x = torch.randn(3, 128, generator=gen)
    assert torch.allclose(layer(x).double(), _reference(source, x[:, source.input_order]), rtol=1e-6, atol=1e-6)
    with pytest.raises(InputError, match="not a permutation"):   # an order with values is checked as before
        FoldLinear(placeholder, enc, input_order=torch.zeros(128, dtype=torch.int64))

def _layer_pair(enc: str, gen: torch.Generator, order: bool = False):
    from foldc.gemm.reference import quantize_2d

    e = parse_gemm_encoding(enc, "weight")
    make = lambda: FoldLinear(quantize_2d(torch.randn(32, 128, generator=gen) * 0.1, e), e,  # noqa: E731
                              bias=torch.randn(32, generator=gen),
                              input_order=torch.randperm(128, generator=gen) if order else None)
    return make(), make()


@pytest.mark.parametrize("key, value, match", [
    ("scale", lambda t: t.half(), r"scale dtype=torch.float16 .*k-group:4:64:bf16"),   # rounded silently before
    ("zero", lambda t: t.float(), r"zero dtype=torch.float32 .*k-group:4:64:bf16"),
    ("codes", lambda t: t.to(torch.int32), r"codes dtype=torch.int32"),
    ("input_order", lambda t: torch.zeros_like(t), "not a permutation"),              # gathered channel 0 everywhere
    ("input_order", lambda t: t + 1000, "not a permutation"),                         # an IndexError at the call
    ("bias", lambda t: t.to(torch.complex64), r"bias dtype=torch.complex64 must be floating point"),  # lost its
])                                                                                    # imaginary part before
def test_a_state_dict_the_layer_cannot_hold_is_refused_at_load(key, value, match):
    """load_state_dict copies into the buffers, casting: bf16 scales took another encoding's fp16 scales rounded,
    and an input order that is no permutation was taken as it came. Both are refused at the load, naming the key."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    source, layer = _layer_pair("k-group:4:64:bf16", gen, order=True)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    state = source.state_dict()
    state[key] = value(state[key])
    for assign in (False, True):
        with pytest.raises(InputError, match=match):
            layer.load_state_dict(state, assign=assign)
        assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def test_a_float_linears_weight_loaded_into_a_fold_linear_is_refused():
    """A model quantized from its random initial weights, then given its float checkpoint with strict=False (as a
    checkpoint loaded shard by shard is): each layer's float ``weight`` was dropped as an unexpected key and the
    layer kept the codes of the random weights. Refused, naming the key, before any change."""
    from foldc.integrations.hf_weights import quantize_model

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    trained = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    for p in trained.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    model = quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)),
                           weight="k-group:8:32", skip=())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (False, True):
        with pytest.raises(InputError, match=r"^0\.weight: .*nn\.Linear's float weight \[32, 64\].*quantize_model"):
            model.load_state_dict(trained.state_dict(), strict=strict)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    quantize_model(trained, weight="k-group:8:32", skip=())   # the float weights quantized: they load
    model.load_state_dict(trained.state_dict())
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(model(x), trained(x))


def test_a_load_with_assign_keeps_the_layout_the_kernels_read():
    """load_state_dict(..., assign=True) (after building on the meta device) put the state dict's tensors in as they
    were: a column-major scale (refused at the first call on the kernels) and the split-k counters left on meta."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    source, _ = _layer_pair("k-group:4:32", gen)
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 32), "k-group:4:32").to("meta")
    state = source.state_dict()
    state["scale"] = state["scale"].transpose(2, 3).contiguous().transpose(2, 3)   # same values, column-major
    layer.load_state_dict(state, assign=True)
    assert layer.scale.is_contiguous() and layer.gemv_counters.device.type == "cpu" and not layer.gemv_counters.any()
    x = torch.randn(4, 128, generator=gen)
    assert torch.allclose(layer(x).double(), _reference(source, x), rtol=1e-6, atol=1e-6)


def test_a_linear_on_the_meta_device_is_refused_by_name():
    """from_linear of an nn.Linear built without memory raised "Tensor.item() cannot be called on meta tensors"
    from inside the quantizer; quantize_model of such a model likewise, naming no layer."""
    from foldc.integrations.hf_weights import quantize_model

    with pytest.raises(InputError, match="meta device.*load its weights first"):
        FoldLinear.from_linear(torch.nn.Linear(128, 32, device="meta"), "k-group:4:64")
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).to("meta")
    with pytest.raises(InputError, match=r"^0 \(128 -> 64\): .*meta device"):
        quantize_model(model, weight="k-group:4:64")
    assert not any(isinstance(m, FoldLinear) for m in model.modules())


class _CodesLinear(torch.nn.Linear):
    """An nn.Linear whose weight another quantizer replaced by its own storage (as bitsandbytes' Linear8bitLt holds
    int8 codes, its scales elsewhere, and Linear4bit packed uint8 of shape [n * k / 2, 1])."""


@pytest.mark.parametrize("weight, match", [
    (lambda w: (w * 127 / w.abs().max()).round().to(torch.int8), r"weight dtype=torch\.int8"),   # codes as values
    (lambda w: w > 0, r"weight dtype=torch\.bool"),                                             # 0/1 as values
    (lambda w: w.to(torch.complex64), r"weight dtype=torch\.complex64"),                        # imaginary part lost
    (lambda w: w.reshape(-1, 1)[: w.numel() // 2], r"weight shape=\(2048, 1\) but the linear is 32 x 128"),
])
def test_a_weight_that_is_not_the_linears_float_matrix_is_refused(weight, match):
    """from_linear quantized whatever the weight held, cast to float32: another quantizer's int8 codes became the
    layer's weights (its scales dropped), a complex weight lost its imaginary part (a warning), all silently; a
    packed weight's shape was taken for the layer's. Refused by name now; the float weight itself converts."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    linear = _CodesLinear(128, 32)
    w = torch.randn(32, 128, generator=gen)
    linear.weight = torch.nn.Parameter(weight(w), requires_grad=False)
    with pytest.raises(InputError, match=match):
        FoldLinear.from_linear(linear, "k-group:4:64")
    linear.weight = torch.nn.Parameter(w)
    layer = FoldLinear.from_linear(linear, "k-group:4:64")
    x = torch.randn(3, 128, generator=gen)
    assert torch.allclose(layer(x).double(), _reference(layer, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_weight_whose_scales_are_kept_apart_is_refused(dtype):
    """An FP8 linear (transformers' FP8Linear, FbgemmFp8Linear: nn.Linear subclasses) holds float8 codes of w / scale
    as its weight and the per-row or per-block scale in another parameter. from_linear and quantize_model took the
    float8 weight as floating point and quantized the codes as the layer's values, the scales dropped: silently a
    weight off by each row's scale. Refused by name now, naming the dtype."""
    from foldc.integrations.hf import quantize_model

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    w = torch.randn(32, 128, generator=gen) * 0.02
    scale = w.abs().amax(1, keepdim=True) / float(torch.finfo(dtype).max)   # the per-row scale, kept apart
    linear = _CodesLinear(128, 32)
    linear.weight = torch.nn.Parameter((w / scale).to(dtype), requires_grad=False)
    linear.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    with pytest.raises(InputError, match=rf"linear's weight dtype={dtype}: an 8-bit float weight is another"):
        FoldLinear.from_linear(linear, "k-group:4:64")
    model = torch.nn.Sequential(linear)
    with pytest.raises(InputError, match=rf"^0's weight dtype={dtype}: .*the model is unchanged"):
        quantize_model(model, weight="k-group:4:64", skip=())
    assert model[0] is linear


@settings(max_examples=8, deadline=None)
@given(enc=st.sampled_from(["k-group:4:32", "k-group:2:64:bf16", "per-channel:8"]), layers=st.integers(2, 4),
       seed=st.integers(0, 2**31 - 1))
def test_layers_built_from_one_weight_hold_their_own_buffers_through_a_load(enc, layers, seed):
    """A serving engine builds its model's layers from one placeholder weight, bias and input order, then loads the
    checkpoint: each layer aliased the placeholder's tensors (``.contiguous()`` of a contiguous tensor is itself), so
    ``load_state_dict``, which copies into the buffers, wrote every layer's state into the same memory and all layers
    computed the last one's. A layer made by from_linear likewise shared its bias with the linear."""
    from foldc.gemm.reference import quantize_2d

    gen = torch.Generator().manual_seed(seed)
    e = parse_gemm_encoding(enc, "weight")
    make = lambda: quantize_2d(torch.randn(32, 128, generator=gen), e)  # noqa: E731
    placeholder, bias, order = make(), torch.randn(32, generator=gen), torch.randperm(128, generator=gen)
    model = torch.nn.Sequential(*[FoldLinear(placeholder, e, bias, input_order=order) for _ in range(layers)])
    sources = [FoldLinear(make(), e, torch.randn(32, generator=gen), input_order=torch.randperm(128, generator=gen))
               for _ in range(layers)]
    model.load_state_dict({f"{i}.{key}": t for i, s in enumerate(sources) for key, t in s.state_dict().items()})
    x = torch.randn(3, 128, generator=gen)
    for layer, source in zip(model, sources):
        assert torch.equal(layer(x), source(x))
    linear = torch.nn.Linear(128, 32)
    layer = FoldLinear.from_linear(linear, e)
    before = layer(x)
    with torch.no_grad():
        linear.bias.add_(torch.randn(32, generator=gen))   # the float linear trained on (or reused) after the copy
    assert torch.equal(layer(x), before)
