"""Tests for foldc.spec: AttentionSpec, spec_from_args, spec_from_toml."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from foldc.encoding import SUPPORTED_BITS, Affine
from foldc.errors import SpecError
from foldc.spec import AttentionSpec, spec_from_args, spec_from_toml

PROP = settings(max_examples=80, deadline=None)
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@st.composite
def valid_specs(draw):
    """A random valid AttentionSpec (plain or Affine K/V)."""
    kv = draw(st.integers(1, 16))
    q = kv * draw(st.integers(1, 8))
    head_dim = 8 * draw(st.integers(1, 32))

    def enc():
        if draw(st.booleans()):
            return None
        bits = draw(st.sampled_from(SUPPORTED_BITS))
        layout = draw(st.sampled_from(["token", "channel"]))
        if layout == "token":
            g = draw(st.sampled_from([d for d in range(1, head_dim + 1) if head_dim % d == 0]))
        else:
            g = draw(st.integers(1, 512))
        return Affine(bits, layout, g, draw(st.sampled_from(list(DTYPE_NAMES))))

    return AttentionSpec(q, kv, head_dim, k=enc(), v=enc())


def write(tmp: Path, text: str, name: str = "layout.toml") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------
# AttentionSpec
# --------------------------------------------------------------------------------------------

@PROP
@given(kv=st.integers(1, 64), m=st.integers(1, 16), head_dim=st.integers(1, 512))
def test_q_per_kv(kv, m, head_dim):
    spec = AttentionSpec(kv * m, kv, head_dim)
    assert spec.q_per_kv == m
    assert spec.k is None and spec.v is None
    assert spec.describe() == f"heads {kv * m}/{kv}, head_dim {head_dim}, K plain, V plain"


@PROP
@given(valid_specs())
def test_valid_spec_describe_names_encodings(spec):
    text = spec.describe()
    for enc in (spec.k, spec.v):
        assert (enc.short() if enc is not None else "plain") in text
    assert f"heads {spec.num_q_heads}/{spec.num_kv_heads}" in text


@PROP
@given(q=st.integers(1, 256), kv=st.integers(1, 64))
def test_q_heads_not_multiple_of_kv_heads(q, kv):
    assume(q % kv)
    with pytest.raises(SpecError) as ei:
        AttentionSpec(q, kv, 128)
    msg = str(ei.value)
    assert f"num_q_heads={q} is not a multiple of num_kv_heads={kv}" in msg


@pytest.mark.parametrize("field", ["num_q_heads", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -8, True, 128.0, "128", None])
def test_heads_and_head_dim_must_be_positive_int(field, value):
    args = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, field: value}
    with pytest.raises(SpecError) as ei:
        AttentionSpec(**args)
    assert f"{field}={value!r} must be a positive integer" in str(ei.value)


@pytest.mark.parametrize("field", ["k", "v"])
@pytest.mark.parametrize("g,head_dim", [(128, 96), (48, 64), (3, 128)])
def test_token_group_not_dividing_head_dim(field, g, head_dim):
    with pytest.raises(SpecError) as ei:
        AttentionSpec(32, 8, head_dim, **{field: Affine(4, "token", g)})
    assert f"group_size={g} does not divide head_dim (for {field})={head_dim}" in str(ei.value)


@pytest.mark.parametrize("field", ["k", "v"])
@pytest.mark.parametrize("bits,head_dim", [(2, 6), (2, 130), (4, 127)])
def test_head_dim_not_multiple_of_codes_per_byte(field, bits, head_dim):
    with pytest.raises(SpecError) as ei:
        AttentionSpec(4, 4, head_dim, **{field: Affine(bits, "channel", 64)})
    assert f"head_dim (for {field})={head_dim} is not a multiple of {8 // bits}" in str(ei.value)


@pytest.mark.parametrize("field", ["k", "v"])
@pytest.mark.parametrize("value", ["token:2:128", 4, object])
def test_encoding_must_be_affine(field, value):
    with pytest.raises(SpecError) as ei:
        AttentionSpec(32, 8, 128, **{field: value})
    assert f"{field}={value!r} must be a foldc.Affine or None" in str(ei.value)


def test_spec_is_frozen():
    spec = AttentionSpec(32, 8, 128)
    with pytest.raises(AttributeError):
        spec.head_dim = 64  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# spec_from_args
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("plain", [None, "", "none", "plain"])
def test_spec_from_args_plain_operands(plain):
    spec = spec_from_args(plain, "channel:2:64", "32/8", 128)
    assert spec.k is None
    assert spec.v == Affine(2, "channel", 64)
    spec = spec_from_args("token:4:32:bf16", plain, "32/8", 128)
    assert spec.k == Affine(4, "token", 32, torch.bfloat16) and spec.v is None


@PROP
@given(valid_specs(), st.booleans())
def test_spec_from_args_round_trip(spec, head_dim_as_text):
    text = lambda e: "none" if e is None else e.short()  # noqa: E731
    head_dim = str(spec.head_dim) if head_dim_as_text else spec.head_dim
    back = spec_from_args(text(spec.k), text(spec.v), f"{spec.num_q_heads}/{spec.num_kv_heads}", head_dim)
    assert back == spec
    assert back.q_per_kv == spec.q_per_kv


@pytest.mark.parametrize("heads", ["32", "32/8/2", "a/b", "", "32-8", "32/"])
def test_spec_from_args_bad_heads(heads):
    with pytest.raises(SpecError) as ei:
        spec_from_args(None, None, heads, 128)
    assert f"heads={heads!r} must look like 'Q/KV'" in str(ei.value)


@pytest.mark.parametrize("head_dim", ["abc", "12.5", ""])
def test_spec_from_args_head_dim_text_not_integer(head_dim):
    with pytest.raises(SpecError) as ei:
        spec_from_args(None, None, "32/8", head_dim)
    assert f"head_dim={head_dim!r} must be a positive integer" in str(ei.value)


@pytest.mark.parametrize("head_dim", [128.5, 128.0, True, 0])
def test_spec_from_args_head_dim_not_silently_coerced(head_dim):
    with pytest.raises(SpecError) as ei:
        spec_from_args(None, None, "32/8", head_dim)
    assert f"head_dim={head_dim!r}" in str(ei.value)


def test_spec_from_args_bad_encoding_and_bad_heads_ratio():
    with pytest.raises(SpecError, match="bits=3"):
        spec_from_args("token:3:128", None, "32/8", 128)
    with pytest.raises(SpecError, match="num_q_heads=12 is not a multiple of num_kv_heads=8"):
        spec_from_args(None, None, "12/8", 128)
    with pytest.raises(SpecError, match=r"head_dim \(for v\)=96"):
        spec_from_args(None, "token:2:128", "32/8", 96)


# --------------------------------------------------------------------------------------------
# spec_from_toml
# --------------------------------------------------------------------------------------------

def test_toml_string_form(tmp_path):
    path = write(tmp_path, '[attention]\nheads = "32/8"\nhead_dim = 128\n'
                           'k = "token:2:128"\nv = "channel:4:64:fp32"\n')
    spec = spec_from_toml(path)
    assert spec == AttentionSpec(32, 8, 128, k=Affine(2, "token", 128),
                                 v=Affine(4, "channel", 64, torch.float32))
    assert spec_from_toml(str(path)) == spec  # str paths too


def test_toml_table_form(tmp_path):
    path = write(tmp_path, '[attention]\nheads = "16/4"\nhead_dim = 64\n'
                           'k = {layout = "token", bits = 4, group_size = 32}\n'
                           '[attention.v]\nlayout = "channel"\nbits = 2\ngroup_size = 48\nscale_dtype = "bf16"\n')
    spec = spec_from_toml(path)
    assert spec == AttentionSpec(16, 4, 64, k=Affine(4, "token", 32),
                                 v=Affine(2, "channel", 48, torch.bfloat16))
    assert spec.q_per_kv == 4


def test_toml_without_attention_header_and_plain_operands(tmp_path):
    path = write(tmp_path, 'heads = "8/8"\nhead_dim = 96\nk = "none"\n')
    assert spec_from_toml(path) == AttentionSpec(8, 8, 96)


@PROP
@given(valid_specs(), st.booleans())
def test_toml_round_trip(tmp_path_factory, spec, table_form):
    def line(key, enc):
        if enc is None:
            return f'{key} = "none"' if table_form else ""
        if table_form:
            return (f'{key} = {{layout = "{enc.layout}", bits = {enc.bits}, group_size = {enc.group_size}, '
                    f'scale_dtype = "{DTYPE_NAMES[enc.scale_dtype]}"}}')
        return f'{key} = "{enc.short()}"'

    text = "\n".join(["[attention]", f'heads = "{spec.num_q_heads}/{spec.num_kv_heads}"',
                      f"head_dim = {spec.head_dim}", line("k", spec.k), line("v", spec.v)]) + "\n"
    path = write(tmp_path_factory.mktemp("spec"), text)
    assert spec_from_toml(path) == spec


@pytest.mark.parametrize("missing", ["heads", "head_dim"])
def test_toml_missing_key(tmp_path, missing):
    lines = {"heads": 'heads = "32/8"', "head_dim": "head_dim = 128"}
    del lines[missing]
    path = write(tmp_path, "[attention]\n" + "\n".join(lines.values()) + '\nk = "token:2:128"\n')
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    assert f"missing key {missing!r}" in str(ei.value) and str(path) in str(ei.value)


@pytest.mark.parametrize("extra", ["hedas = 4", "group_size = 128", 'K = "token:2:128"'])
def test_toml_unknown_key(tmp_path, extra):
    path = write(tmp_path, f'[attention]\nheads = "32/8"\nhead_dim = 128\n{extra}\n')
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    key = extra.split(" = ")[0]
    assert f"unknown keys [{key!r}]" in str(ei.value)


@pytest.mark.parametrize("key", ["k", "v"])
@pytest.mark.parametrize("attention_header", [True, False])
def test_toml_empty_encoding_is_not_a_plain_operand(tmp_path, key, attention_header):
    """``k = ""`` (a template's unset value) read as a plain operand: a spec with an unquantized K came back
    silently, where the CLI refuses ``--k ''``. Now an error names the key and the fix."""
    lines = {"k": 'k = "token:2:128"', "v": 'v = "channel:2:128"', key: f'{key} = ""'}
    header = "[attention]\n" if attention_header else ""
    path = write(tmp_path, header + 'heads = "32/8"\nhead_dim = 128\n' + "\n".join(lines.values()) + "\n")
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    msg = str(ei.value)
    assert str(path) in msg and f"{key}='' is empty" in msg and "'none'" in msg


def test_toml_table_unknown_key(tmp_path):
    path = write(tmp_path, '[attention]\nheads = "32/8"\nhead_dim = 128\n'
                           'k = {layout = "token", bits = 2, group_size = 128, width = 3}\n')
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    assert "[k] has unknown keys ['width']" in str(ei.value)


@pytest.mark.parametrize("drop", ["layout", "bits", "group_size"])
def test_toml_table_missing_field(tmp_path, drop):
    fields = {"layout": '"channel"', "bits": "2", "group_size": "64"}
    del fields[drop]
    table = ", ".join(f"{k} = {v}" for k, v in fields.items())
    path = write(tmp_path, f'[attention]\nheads = "32/8"\nhead_dim = 128\nv = {{{table}}}\n')
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    assert f"[v] is missing {drop!r}" in str(ei.value)


@pytest.mark.parametrize("table,key", [
    ('{layout = "token", bits = 2, group_size = "128:fp32"}', "group_size"),   # fp32 scales, silently
    ('{layout = "channel:4", bits = 64, group_size = "fp32"}', "layout"),     # channel:4:64:fp32, silently
    ('{layout = "token", bits = "4:32", group_size = "bf16"}', "bits"),       # token:4:32:bf16, silently
    ('{layout = {a = 1}, bits = 2, group_size = 128}', "layout"),             # a message about scale dtype '128'
])
def test_toml_table_field_holding_other_fields(tmp_path, table, key):
    """The table's fields were joined into 'layout:bits:group_size[:scale_dtype]' text and parsed again, so a
    field holding a ':' filled the next fields: bits of 64 or a group size of "fp32" came out as a valid encoding."""
    path = write(tmp_path, f'[attention]\nheads = "32/8"\nhead_dim = 128\nk = {table}\n')
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    msg = str(ei.value)
    assert f"[k] {key}=" in msg and "one value" in msg, msg


def test_toml_table_fields_as_text_still_parse(tmp_path):
    path = write(tmp_path, '[attention]\nheads = "32/8"\nhead_dim = 128\n'
                           'k = {layout = "token", bits = "4", group_size = "32", scale_dtype = "bf16"}\n')
    assert spec_from_toml(path).k == Affine(4, "token", 32, torch.bfloat16)


@pytest.mark.parametrize("text", ['[attention\nheads = "32/8"\n', 'heads = 32/8\n', 'head_dim = \n',
                                  'heads = "32/8"\nheads = "16/4"\n'])
def test_toml_bad_syntax(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    assert "is not valid TOML" in str(ei.value) and str(path) in str(ei.value)


def test_toml_missing_file(tmp_path):
    path = tmp_path / "does_not_exist.toml"
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    assert "cannot read layout file" in str(ei.value) and repr(str(path)) in str(ei.value)


@pytest.mark.parametrize("body,needle", [
    ('heads = "12/8"\nhead_dim = 128\n', "num_q_heads=12"),
    ('heads = 32\nhead_dim = 128\n', "heads=32"),
    ('heads = "32/8"\nhead_dim = 128.5\n', "head_dim=128.5"),
    ('heads = "32/8"\nhead_dim = true\n', "head_dim=True"),
    ('heads = "32/8"\nhead_dim = "wide"\n', "head_dim='wide'"),
    ('heads = "32/8"\nhead_dim = 96\nk = "token:2:128"\n', "head_dim (for k)=96"),
    ('heads = "32/8"\nhead_dim = 128\nk = "token:5:128"\n', "bits=5"),
    ('heads = "32/8"\nhead_dim = 128\nv = 4\n', "encoding 4 must be a string"),
    ('heads = "32/8"\nhead_dim = 128\nk = {layout = "token", bits = 2, group_size = 64, scale_dtype = "fp8"}\n',
     "scale dtype 'fp8'"),
])
def test_toml_invalid_values_raise_spec_error(tmp_path, body, needle):
    path = write(tmp_path, "[attention]\n" + body)
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    assert needle in str(ei.value)


# --------------------------------------------------------------------------------------------
# limits and misplaced TOML keys (issue 17)
# --------------------------------------------------------------------------------------------

def test_largest_spec_is_accepted():
    from foldc.spec import MAX_HEAD_DIM, MAX_HEADS

    spec = AttentionSpec(MAX_HEADS, MAX_HEADS, MAX_HEAD_DIM)
    assert (spec.num_q_heads, spec.head_dim) == (1024, 1024)


@pytest.mark.parametrize("field,value,limit", [("num_q_heads", 2048, "MAX_HEADS"), ("num_kv_heads", 1025, "MAX_HEADS"),
                                               ("head_dim", 1025, "MAX_HEAD_DIM"), ("head_dim", 10**6, "MAX_HEAD_DIM")])
def test_sizes_past_the_limits(field, value, limit):
    args = {"num_q_heads": 8, "num_kv_heads": 8, "head_dim": 128, field: value}
    with pytest.raises(SpecError) as ei:
        AttentionSpec(**args)
    assert f"{field}={value!r} must be a positive integer <= 1024" in str(ei.value) and limit in str(ei.value)


def test_spec_from_args_huge_heads():
    with pytest.raises(SpecError, match="num_q_heads=100000 must be a positive integer <= 1024"):
        spec_from_args("token:2:128", "none", "100000/1", 128)


@pytest.mark.parametrize("key", ["k", "v", "heads", "head_dim"])
def test_toml_key_above_the_attention_header(tmp_path, key):
    value = {"k": '"token:2:64"', "v": '"token:2:64"', "heads": '"8/2"', "head_dim": "64"}[key]
    body = {"heads": 'heads = "8/2"', "head_dim": "head_dim = 64"}
    body.pop(key, None)
    path = write(tmp_path, f"{key} = {value}\n[attention]\n" + "\n".join(body.values()) + "\n")
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    assert f"[{key!r}] stand above the [attention] header" in str(ei.value) and str(path) in str(ei.value)


@pytest.mark.parametrize("extra", ["[extra]\nx = 1\n", "[gemmm]\nn = 4\n", "note = 'hi'\n"])
def test_toml_extra_table_next_to_attention(tmp_path, extra):
    first, rest = ("", extra) if extra.startswith("[") else (extra, "")
    path = write(tmp_path, f'{first}[attention]\nheads = "8/2"\nhead_dim = 64\n{rest}')
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    name = extra.strip("[").split("]")[0].split(" = ")[0]
    assert f"unknown top-level key(s) or table(s) [{name!r}]" in str(ei.value)


@pytest.mark.parametrize("text", ["attention = 5\n", 'attention = "8/2"\n', "attention = [1, 2]\n"])
def test_toml_attention_not_a_table(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    assert f"attention={tomllib_value(text)!r} must be a table" in str(ei.value)


def tomllib_value(text: str):
    import tomllib

    return tomllib.loads(text)["attention"]


def test_toml_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[attention]\nheads = "8/2"  # caf\xe9\nhead_dim = 64\n'.encode("latin-1"))
    with pytest.raises(SpecError) as ei:
        spec_from_toml(path)
    assert f"layout file {str(path)!r} is not UTF-8 text" in str(ei.value) and "save it as UTF-8" in str(ei.value)


@PROP
@given(valid_specs())
def test_toml_with_a_byte_order_mark_reads_as_without(tmp_path_factory, spec):
    """A layout file saved as "UTF-8 with BOM" (Windows editors) failed as 'not valid TOML: Invalid statement (at line
    1, column 1)', naming neither the mark nor the fix; it is UTF-8 text, and reads as the same file without it."""
    text = lambda e: "none" if e is None else e.short()  # noqa: E731
    body = (f'[attention]\nheads = "{spec.num_q_heads}/{spec.num_kv_heads}"\nhead_dim = {spec.head_dim}\n'
            f'k = "{text(spec.k)}"\nv = "{text(spec.v)}"\n')
    path = tmp_path_factory.mktemp("bom") / "layout.toml"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert spec_from_toml(path) == spec


def test_toml_path_is_a_folder(tmp_path):
    with pytest.raises(SpecError) as ei:
        spec_from_toml(tmp_path)
    assert f"cannot read layout file {str(tmp_path)!r}" in str(ei.value)


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["numpy", "torch"]), width=st.sampled_from([8, 16, 32, 64]),
       heads=st.sampled_from([(32, 8), (8, 8), (40, 8), (64, 2)]), bits=st.sampled_from([2, 4, 8]),
       group=st.sampled_from([32, 64, 128]), dim=st.sampled_from([64, 128, 256]))
def test_numpy_and_0_dim_torch_integers_are_the_ints_they_hold(kind, width, heads, bits, group, dim):
    """A positive NumPy integer (or a 0-dim torch integer: a size read from an array or a config) was refused by
    AttentionSpec and Affine as "must be a positive integer" (GemmSpec took it). Each is the int it holds now: the
    spec equals and hashes as the one of Python ints; floats and bools of either kind are still refused."""
    import numpy as np

    def wrap(x):
        if kind == "numpy":
            return getattr(np, f"int{width}")(x)
        return torch.tensor(x, dtype=getattr(torch, f"int{width}"))
    assume(max(heads + (dim, group)) < 2 ** (width - 1) and dim % group == 0)
    enc = Affine(wrap(bits), "token", wrap(group))
    spec = AttentionSpec(wrap(heads[0]), wrap(heads[1]), wrap(dim), enc, enc)
    plain = AttentionSpec(heads[0], heads[1], dim, Affine(bits, "token", group),
                                Affine(bits, "token", group))
    assert spec == plain and hash(spec) == hash(plain) and spec.describe() == plain.describe()
    assert all(type(x) is int for x in (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, enc.bits, enc.group_size))
    for bad in (np.float64(bits), np.bool_(True), torch.tensor(float(bits)), torch.tensor(True)):
        with pytest.raises(SpecError, match="bits="):
            Affine(bad, "token", group)
        with pytest.raises(SpecError, match="head_dim="):
            AttentionSpec(heads[0], heads[1], bad, None, None)
