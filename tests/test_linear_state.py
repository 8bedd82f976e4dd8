"""A `FoldLinear`'s state dict records its weight's encoding (`foldc.linear_state`, the ``_extra_state`` key): a
round trip (torch.save, safetensors) keeps the layer's outputs bit for bit, a state dict of another encoding whose
tensors have the same shapes (and dtypes) is refused naming both, and one saved before the record loads as before.
CPU: float32 inputs run the float64 plan executor."""
from __future__ import annotations

import io
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foldc import linear_state
from foldc.errors import FoldError, InputError
from foldc.gemm import parse_gemm_encoding
from foldc.gemm.reference import quantize_2d
from foldc.nn import FoldLinear


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def _layer(enc: str, k: int, gen: torch.Generator, n: int = 32, order: bool = False, bias: bool = True):
    """A layer of fresh random weights (never zeros), bias and input order."""
    e = parse_gemm_encoding(enc, "weight")
    return FoldLinear(quantize_2d(torch.randn(n, k, generator=gen) * 0.1, e), e,
                      bias=torch.randn(n, generator=gen) if bias else None,
                      input_order=torch.randperm(k, generator=gen) if order else None)


def _saved(state: dict, how: str) -> dict:
    """``state`` through a file: torch.save (read back with weights_only) or safetensors."""
    if how == "torch":
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)
    safetensors = pytest.importorskip("safetensors.torch")
    return safetensors.load(safetensors.save(state))


@settings(max_examples=12, deadline=None)
@given(enc=st.sampled_from(["k-group:4:128", "k-group:2:64:bf16", "k-group:8:32:fp32", "per-channel:4"]),
       order=st.booleans(), bias=st.booleans(), how=st.sampled_from(["torch", "safetensors"]),
       seed=st.integers(0, 2**31 - 1))
def test_a_state_dict_round_trip_keeps_the_outputs_bit_for_bit(enc, order, bias, how, seed):
    gen = torch.Generator().manual_seed(seed)
    source, target = _layer(enc, 256, gen, order=order, bias=bias), _layer(enc, 256, gen, order=order, bias=bias)
    state = _saved(source.state_dict(), how)
    record = json.loads(bytes(state["_extra_state"].tolist()))
    assert record["weight"] == enc and record["in_features"] == 256 and record["input_order"] == order
    assert target.load_state_dict(state).missing_keys == []
    rebuilt = FoldLinear.from_state_dict(state)
    assert rebuilt.encoding == source.encoding and (rebuilt.input_order is None) == (not order)
    x = torch.randn(3, 256, generator=gen)
    want = source(x)
    assert torch.equal(target(x), want) and torch.equal(rebuilt(x), want)


# pairs of layers whose tensors have the same shapes and dtypes but mean other weights: (encoding, in_features)
SAME_SHAPES = [
    (("k-group:4:128", 256), ("k-group:8:64", 128)),     # codes [32, 128], scales [32, 2]
    (("k-group:2:128", 512), ("k-group:4:64", 256)),     # codes [32, 128], scales [32, 4]
    (("per-channel:4", 256), ("per-channel:8", 128)),    # codes [32, 128], scales [32, 1]
    (("k-group:4:256", 256), ("per-channel:8", 128)),
]


@pytest.mark.parametrize("saved, built", SAME_SHAPES + [(b, a) for a, b in SAME_SHAPES])
def test_a_state_dict_of_another_encoding_with_the_same_shapes_is_refused_naming_both(saved, built):
    """These loaded silently before (same shapes, same dtypes) and the layer computed another weight."""
    gen = _gen()
    source, layer = _layer(*saved, gen), _layer(*built, gen)
    state = source.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in state.items() if k != "_extra_state"} == \
        {k: (v.shape, v.dtype) for k, v in layer.state_dict().items() if k != "_extra_state"}
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(InputError, match=rf"{saved[0]} over in_features={saved[1]} .*"
                                             rf"this FoldLinear's is {built[0]} over in_features={built[1]}"
                                             rf".*from_state_dict.*weight='{saved[0]}'"):
            layer.load_state_dict(state, strict=strict)
        assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    x = torch.randn(2, saved[1], generator=gen)
    assert torch.equal(FoldLinear.from_state_dict(state)(x), source(x))   # the fix the message names


@pytest.mark.parametrize("saved, built", [("k-group:4:64", "k-group:4:64:bf16"), ("k-group:8:32:fp32", "k-group:8:32"),
                                          ("per-channel:4:bf16", "per-channel:4:fp32")])
def test_a_state_dict_of_another_scale_dtype_is_refused_naming_both_encodings(saved, built):
    """A scale dtype the load's copy would convert was refused naming only this layer's encoding; the record names
    both."""
    gen = _gen()
    layer = _layer(built, 128, gen)
    with pytest.raises(InputError, match=rf"encoded as {saved} over .* this FoldLinear's is {built} over"):
        layer.load_state_dict(_layer(saved, 128, gen).state_dict())


@pytest.mark.parametrize("saved_order", [True, False])
def test_a_state_dict_of_an_act_order_layer_and_a_layer_without_one_do_not_mix(saved_order):
    """With strict=False an act-order layer's input order was dropped as an unexpected key (and a layer with an
    order kept its own for a state dict without one): x's channels met the weight's columns in another order."""
    gen = _gen()
    source, layer = _layer("k-group:4:64", 128, gen, order=saved_order), _layer("k-group:4:64", 128, gen,
                                                                                  order=not saved_order)
    with pytest.raises(InputError, match="act-order"):
        layer.load_state_dict(source.state_dict(), strict=False)


@settings(max_examples=30, deadline=None)
@given(row_bytes=st.sampled_from([32, 64]), groups=st.sampled_from([1, 2, 4]),
       bits=st.tuples(st.sampled_from([2, 4, 8]), st.sampled_from([2, 4, 8])),
       dtypes=st.tuples(st.sampled_from(["", ":bf16", ":fp32"]), st.sampled_from(["", ":bf16", ":fp32"])),
       per_channel=st.tuples(st.booleans(), st.booleans()), seed=st.integers(0, 2**31 - 1))
def test_a_load_between_layers_of_equal_shapes_succeeds_exactly_when_they_mean_the_same_weight(
        row_bytes, groups, bits, dtypes, per_channel, seed):
    """Any two layers whose codes and scales have the same shapes (``row_bytes`` of codes and ``groups`` scales a
    row): the load succeeds, bit for bit, where both hold one weight (``per-channel:b`` is ``k-group:b:k``), and is
    refused naming both encodings (or, before the record, by dtype or not at all) where they do not."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for b, dt, pc in zip(bits, dtypes, per_channel):
        k = row_bytes * 8 // b
        enc = f"per-channel:{b}{dt}" if pc and groups == 1 else f"k-group:{b}:{k // groups}{dt}"
        layers.append(_layer(enc, k, gen))
    source, layer = layers
    if bits[0] == bits[1] and dtypes[0] == dtypes[1]:
        layer.load_state_dict(source.state_dict())
        x = torch.randn(2, layer.in_features, generator=gen)
        assert torch.equal(layer(x), source(x))
    else:
        with pytest.raises(InputError, match=rf"{source.encoding.short()} over .* {layer.encoding.short()} over"):
            layer.load_state_dict(source.state_dict())


@pytest.mark.parametrize("strict", [True, False])
def test_a_state_dict_saved_before_the_record_loads_as_before(strict):
    """A checkpoint without ``_extra_state`` (saved before foldc wrote it) loads with strict=True too, bit for bit;
    its tensors' dtypes are still checked, and from_state_dict, which needs the record, says how to load it."""
    gen = _gen()
    source, layer = _layer("k-group:4:64:bf16", 128, gen, order=True), _layer("k-group:4:64:bf16", 128, gen,
                                                                               order=True)
    old = {k: v for k, v in source.state_dict().items() if k != "_extra_state"}
    result = layer.load_state_dict(old, strict=strict)
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.randn(3, 128, generator=gen)
    assert torch.equal(layer(x), source(x))
    with pytest.raises(InputError, match="scale dtype=torch.float16"):
        layer.load_state_dict({**old, "scale": old["scale"].half()}, strict=strict)
    with pytest.raises(InputError, match=r"no '_extra_state'.*FoldLinear\(weight, encoding\)"):
        FoldLinear.from_state_dict(old)
    plain = _layer("k-group:4:64:bf16", 128, gen)
    with pytest.raises(InputError, match="act-order layer's"):   # (strict=False dropped the order silently)
        plain.load_state_dict(old, strict=strict)


@pytest.mark.parametrize("change, match", [
    (lambda t: t.float(), "1-D uint8 tensor"),                                   # every tensor of the state dict cast
    (lambda t: torch.tensor(list(b"not json"), dtype=torch.uint8), "not a FoldLinear's record"),
    (lambda t: json.dumps({"format": "other"}), "format 'other'"),
    (lambda t: _edit(t, version=2), "newer foldc"),
    (lambda t: _edit(t, packing="interleaved"), "packed 'interleaved'"),
    (lambda t: _edit(t, in_features="128"), "field 'in_features'"),
    (lambda t: _edit(t, weight="k-group:3:64"), "weight encoding 'k-group:3:64'"),
    (lambda t: _edit(t, weight="k-group:4:32"), "k-group:4:32 over .* this FoldLinear's is k-group:4:64"),
])
def test_a_damaged_or_foreign_record_is_refused_by_name(change, match):
    gen = _gen()
    layer = _layer("k-group:4:64", 128, gen)
    state = _layer("k-group:4:64", 128, gen).state_dict()
    state["_extra_state"] = change(state["_extra_state"])
    with pytest.raises(FoldError, match=match):
        layer.load_state_dict(state)
    rebuild = match if "FoldLinear's is" not in match else r"tensors do not fit its record .*k-group:4:32"
    with pytest.raises(FoldError, match=rebuild):
        FoldLinear.from_state_dict(state)


def _edit(record: torch.Tensor, **fields) -> dict:
    return {**json.loads(bytes(record.tolist())), **fields}


def test_a_whole_model_names_the_layer_and_from_state_dict_takes_a_prefix():
    gen = _gen()
    model = torch.nn.Sequential(_layer("k-group:4:64", 128, gen, n=64), torch.nn.GELU(),
                                _layer("k-group:4:32", 64, gen, n=16, order=True))
    other = torch.nn.Sequential(_layer("k-group:4:64", 128, gen, n=64), torch.nn.GELU(),
                                _layer("k-group:4:64", 64, gen, n=16, order=True))
    state = model.state_dict()
    with pytest.raises(InputError, match=r"^2\._extra_state: .*k-group:4:32 .* k-group:4:64"):
        other.load_state_dict(state)
    x = torch.randn(2, 64, generator=gen)
    assert torch.equal(FoldLinear.from_state_dict(state, prefix="2.")(x), model[2](x))


def test_the_record_is_read_at_state_dict_time_only(monkeypatch):
    """The forward, torch.compile's trace, torch.export and a deep copy never make or read the record."""
    import copy

    gen = _gen()
    layer = _layer("k-group:4:64", 128, gen)
    x = torch.randn(3, 128, generator=gen)
    want = layer(x)

    def refuse(*args):
        raise AssertionError("the record was made or read outside a state dict")
    monkeypatch.setattr(linear_state, "record_tensor", refuse)
    monkeypatch.setattr(linear_state, "read_record", refuse)
    compiled = torch.compile(torch.nn.Sequential(layer, torch.nn.GELU()), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), torch.nn.functional.gelu(want))
    assert torch.equal(copy.deepcopy(layer)(x), want)
    assert torch.equal(torch.export.export(layer, (x,)).module()(x), want)


def test_a_model_built_on_the_meta_device_saves_a_record_and_takes_a_state_dict_of_placeholders():
    """Built under ``with torch.device("meta")`` the record was made there too (unreadable); a state dict of meta
    placeholders (``assign=True``, structure only) holds no record to check."""
    gen = _gen()
    source = _layer("k-group:4:64", 128, gen)
    with torch.device("meta"):
        state = source.to("meta").state_dict()
    assert state["_extra_state"].device.type == "cpu" and state["codes"].is_meta
    layer = _layer("k-group:4:64", 128, gen).to("meta")
    layer.load_state_dict({k: v.to("meta") for k, v in state.items()}, assign=True)
    assert layer.codes.is_meta
    with pytest.raises(InputError, match="k-group:4:64 over .* k-group:8:64 over"):
        _layer("k-group:8:64", 64, gen).to("meta").load_state_dict(state, assign=True)
