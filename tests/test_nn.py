"""`foldc.nn.FoldLinear` (CPU: the float64 plan executor for float32 inputs, Triton's interpreter for
fp16): its output against float64 over the dequantized weight, the plan proved when it is built,
converted weights, the custom op's registration (opcheck) and a torch.compile trace through its fake."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.gemm import parse_gemm_encoding
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
    assert set(state) == {"codes", "scale", "zero", "bias"}
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


def test_the_custom_op_passes_opcheck_and_traces_through_torch_compile():
    torch.manual_seed(2)
    layer = FoldLinear.from_linear(torch.nn.Linear(128, 32), "k-group:4:64")
    x = torch.randn(3, 128)
    args = (x, layer.codes, layer.scale, layer.zero, layer.bias, layer.encoding.short(), 32)
    torch.library.opcheck(torch.ops.foldc.linear.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    model = torch.nn.Sequential(layer, torch.nn.GELU())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), model(x))


def test_the_layer_owns_its_gemv_counters_outside_its_state():
    """The GPU GEMV's split-k counters live on the layer (a compiled step's CUDA graph sees them): int32
    zeros, one per 16 output channels, moved by .to(), not saved in the state dict."""
    layer = FoldLinear.from_linear(torch.nn.Linear(64, 40, bias=False), "k-group:4:32")
    assert layer.gemv_counters.dtype == torch.int32 and layer.gemv_counters.shape == (3,)
    assert not layer.gemv_counters.any() and "gemv_counters" not in layer.state_dict()
    assert layer.to(torch.float64).gemv_counters.dtype == torch.int32
