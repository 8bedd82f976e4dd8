"""foldc/gemm/spec.py: GEMM encodings written as TOML tables."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foldc.errors import SpecError
from foldc.gemm import GemmSpec, parse_gemm_encoding
from foldc.gemm.spec import MAX_SIZE
from foldc.spec import spec_from_toml


@pytest.mark.parametrize("table,field", [
    ('{ kind = "k-group", bits = "4:32" }', "bits"),                          # k-group:4:32, silently
    ('{ kind = "k-group", bits = 4, group_size = "32:bf16" }', "group_size"),  # bf16 scales, silently
    ('{ kind = "per-channel:8", bits = "bf16" }', "kind"),                    # per-channel:8:bf16, silently
])
def test_table_field_holding_other_fields(tmp_path, table, field):
    """The table's fields were joined into 'kind:bits[:group_size][:scale_dtype]' text and parsed again: a field
    holding a ':' filled the next ones, and a table missing group_size or holding bits="bf16" came out valid."""
    path = tmp_path / "layout.toml"
    path.write_text(f"[gemm]\nn = 64\nk = 128\nweight = {table}\n")
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    msg = str(ei.value)
    assert f"weight encoding's {field}=" in msg and "one value" in msg and "[gemm]" in msg, msg


def test_table_fields_still_parse():
    enc = parse_gemm_encoding({"kind": "k-group", "bits": 4, "group_size": "32", "scale_dtype": "bf16"}, "weight")
    assert enc.short() == "k-group:4:32:bf16"


@pytest.mark.parametrize("key,other", [("activation", 'weight = "per-channel:8"'),
                                       ("weight", 'activation = "per-token:8"')])
def test_an_empty_encoding_is_not_a_plain_operand(tmp_path, key, other):
    """``activation = ""`` (a template's unset value) read as plain fp16 activations: a W8A8 layout became W8A16
    silently; ``weight = ""`` was named weight=None. Now an error names the key and the fix."""
    path = tmp_path / "layout.toml"
    path.write_text(f'[gemm]\nn = 64\nk = 128\n{other}\n{key} = ""\n')
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    msg = str(ei.value)
    assert f"{key}='' is empty" in msg and "'none'" in msg and str(path) in msg, msg


# sizes: n, k and m past 2**31 - 1, and values that are no positive integer


def _weight(text: str):
    return parse_gemm_encoding(text, "weight")


@pytest.mark.parametrize("sizes, field, fix", [
    ({"n": 2**31, "k": 256}, "n=2147483648 output channels", "parts of fewer output channels"),
    ({"n": 64, "k": 2**32}, "k=4294967296 input channels", "parts of fewer input channels"),
    ({"n": 64, "k": 256, "m": 2**31}, "m=2147483648 rows of x", "fewer rows at a time"),
])
@pytest.mark.parametrize("weight", ["k-group:4:128", "per-channel:8"])
def test_sizes_past_32_bit_numbering_are_refused_naming_the_value_and_the_fix(sizes, field, fix, weight):
    """The kernels number rows, output and input channels in int32 (``program_id * BLOCK + arange``, the k loop):
    such a spec was accepted (a per-channel one then failed naming a group size nobody gave)."""
    with pytest.raises(SpecError, match=rf"^{field} is past 2147483647 .*MAX_SIZE.*{fix}"):
        GemmSpec(weight=_weight(weight), **sizes)
    top = GemmSpec(MAX_SIZE, 256, weight=_weight(weight), m=MAX_SIZE)   # the largest is taken
    assert GemmSpec(64, 2**31 - 256, weight=_weight("k-group:4:128")).k == 2**31 - 256 and top.n == MAX_SIZE


@pytest.mark.parametrize("value", [0, -64, True, 64.0, "64", None, np.float64(64)])
def test_a_size_that_is_no_positive_integer_is_refused_naming_it(value):
    for sizes in ({"n": value, "k": 256}, {"n": 64, "k": value}):
        with pytest.raises(SpecError, match=r"^[nk]=.* must be a positive integer"):
            GemmSpec(weight=_weight("k-group:4:128"), **sizes)
    if value is not None:   # (m=None is a symbolic row count)
        with pytest.raises(SpecError, match=r"^m=.* must be a positive integer or None \(symbolic\)"):
            GemmSpec(64, 256, weight=_weight("k-group:4:128"), m=value)


def test_numpy_and_torch_integers_are_sizes():
    """A NumPy or 0-dim torch integer (a shape read from an array) was refused as "n=np.int64(64) must be a positive
    integer"; it is one, and the spec holds it as an int (equal to, and hashed as, the spec of plain ints)."""
    spec = GemmSpec(np.int64(64), torch.tensor(256), weight=_weight("k-group:4:128"), m=np.int32(8))
    assert spec == GemmSpec(64, 256, weight=_weight("k-group:4:128"), m=8)
    assert all(type(v) is int for v in (spec.n, spec.k, spec.m)) and hash(spec) == hash(GemmSpec(
        64, 256, weight=_weight("k-group:4:128"), m=8))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 96), bits=st.sampled_from([2, 4, 8]),
       group=st.one_of(st.none(), st.integers(1, 96)), scale=st.sampled_from(["", ":bf16", ":fp32"]),
       m=st.sampled_from([1, 3, 20]), seed=st.integers(0, 2**31 - 1))
def test_a_spec_is_refused_or_computes_its_product(n, k, bits, group, scale, m, seed):
    """Any n, k and encoding at small sizes (odd n, k of a few bytes, groups that do not divide k or cross a packed
    byte's bit fields): the spec is refused with a SpecError naming a value, or the float64 executor and the
    generated Triton kernel (Triton's interpreter) compute x @ W.T of the dequantized weight."""
    from foldc.compile import compile as compile_gemm
    from foldc.gemm.reference import quantize_2d

    text = (f"k-group:{bits}:{group}" if group else f"per-channel:{bits}") + scale
    try:
        spec = GemmSpec(n, k, weight=_weight(text))
    except SpecError as e:
        per_byte = 8 // bits
        assert k % per_byte or (group and (k % group or ((k // per_byte) % group and group % (k // per_byte)))), e
        assert re.match(r"^(k|group_size)=\d+ ", str(e)), e
        return
    gen = torch.Generator().manual_seed(seed)
    w = quantize_2d(torch.randn(n, k, generator=gen), spec.weight)
    x = torch.randn(m, k, generator=gen).half()
    want = x.double() @ w.dequantize(torch.float64)[0, 0].T
    assert torch.allclose(compile_gemm(spec, "reference")(x, w).double(), want, rtol=1e-9, atol=1e-9)
    got = compile_gemm(spec, "interpret")(x, w).double()
    assert float((got - want).norm()) <= 2e-3 * float(want.norm()) + 1e-3


def test_numpy_integers_in_an_encoding_are_the_ints_they_hold():
    """GemmEncoding('k-group', 4, np.int64(128)) was refused as 'a k-group encoding needs a positive group size'
    (GemmSpec takes NumPy sizes, Affine NumPy bits)."""
    from foldc.gemm.spec import GemmEncoding

    enc = GemmEncoding("k-group", np.int64(4), np.int64(128))
    assert enc == GemmEncoding("k-group", 4, 128) and type(enc.bits) is int and type(enc.group_size) is int
    assert enc.short() == "k-group:4:128"
    assert GemmSpec(64, 256, weight=enc).weight_affine() == GemmSpec(64, 256, weight=GemmEncoding("k-group", 4, 128)
                                                                     ).weight_affine()
