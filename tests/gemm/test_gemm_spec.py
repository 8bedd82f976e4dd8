"""foldc/gemm/spec.py: GEMM encodings written as TOML tables."""
from __future__ import annotations

import pytest

from foldc.errors import SpecError
from foldc.gemm import parse_gemm_encoding
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
