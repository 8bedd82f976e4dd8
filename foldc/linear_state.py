"""What a `foldc.nn.FoldLinear` saves in its state dict besides its tensors: the weight's encoding and the layout
facts its tensors' meaning depends on, under the key ``<prefix>_extra_state`` (torch's ``get_extra_state``).

The codes, scales and zeros alone do not say what they encode: a 4-bit weight in groups of 128 over 256 input
channels and an 8-bit one in groups of 64 over 128 have tensors of the same shapes and dtypes, and a copy into a
layer of the other encoding succeeds and computes another weight. The record names the encoding, so a load into a
layer of another one is refused by name.

The record is a dict of plain values, e.g.::

    {"format": "foldc.FoldLinear", "version": 1, "weight": "k-group:4:128", "in_features": 4096,
     "out_features": 11008, "packing": "planar", "dequantize": "scale * code + zero", "input_order": false}

``weight`` is the encoding's text as `foldc.gemm.parse_gemm_encoding` reads it; ``packing`` the order of the codes
in their bytes (`foldc.encoding`'s module doc); ``dequantize`` how a code becomes a value (no code bias: a tool's
``scale * (code - zero)`` is converted to this form when the weight is made); ``input_order`` whether the layer
gathers x by a permutation (act-order), saved as the ``input_order`` tensor. It is stored as its JSON text in a 1-D
uint8 tensor (UTF-8 bytes), so that a state dict stays a dict of tensors: safetensors files, transformers'
``save_pretrained`` and code that moves every entry with ``.to()`` take it as they take the weights. `read_record`
also takes the record as a dict or as its JSON text.
"""
from __future__ import annotations

import json

import torch

from .errors import InputError, SpecError
from .gemm.spec import GemmEncoding, parse_gemm_encoding

KEY = torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX   # "_extra_state"
FORMAT = "foldc.FoldLinear"
VERSION = 1
PACKING = "planar"
DEQUANTIZE = "scale * code + zero"
_FIELDS = {"format": str, "version": int, "weight": str, "in_features": int, "out_features": int, "packing": str,
           "dequantize": str, "input_order": bool}


def layer_record(encoding: GemmEncoding, in_features: int, out_features: int, input_order: bool) -> dict:
    """The record of a layer of this encoding, shape and input order (module doc)."""
    return {"format": FORMAT, "version": VERSION, "weight": encoding.short(), "in_features": in_features,
            "out_features": out_features, "packing": PACKING, "dequantize": DEQUANTIZE, "input_order": input_order}


def record_tensor(record: dict) -> torch.Tensor:
    """``record`` as its JSON text in a 1-D uint8 tensor of UTF-8 bytes (the form the state dict holds)."""
    text = json.dumps(record, sort_keys=True).encode("utf-8")
    # on the CPU, whatever the default device (a model built under ``with torch.device("meta")`` saves one too)
    return torch.tensor(list(text), dtype=torch.uint8, device="cpu")


def read_record(value, key: str) -> dict | None:
    """The record saved under ``key``, checked: a uint8 tensor of JSON text (`record_tensor`), the text itself, or the
    dict; None for a tensor on the meta device (a state dict of placeholders, whose values are not there to check).
    Refused with an InputError naming ``key``: anything else, a record of another format or of a newer version, a
    missing field or one of the wrong type, an encoding foldc does not read, a packing it does not know."""
    if isinstance(value, torch.Tensor):
        if value.is_meta and value.dtype == torch.uint8:
            return None
        if value.dtype != torch.uint8 or value.dim() != 1:
            raise InputError(f"{key}: a FoldLinear saves its encoding as a 1-D uint8 tensor of JSON text, got "
                             f"{value.dtype} {tuple(value.shape)} on {value.device}; pass the state dict's "
                             "_extra_state entry unchanged (a cast of every tensor of a state dict changes it too)")
        value = bytes(value.cpu().tolist()).decode("utf-8", errors="replace")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InputError(f"{key} is not a FoldLinear's record (JSON text): {e}") from None
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        got = value.get("format") if isinstance(value, dict) else type(value).__name__
        raise InputError(f"{key} is not a FoldLinear's record (format {got!r}, expected {FORMAT!r}): the state dict "
                         "is another module's")
    for field, kind in _FIELDS.items():
        got = value.get(field)
        if not isinstance(got, kind) or (kind is int and isinstance(got, bool)):
            raise InputError(f"{key}: field {field!r} is {got!r}, expected a {kind.__name__}: the record was changed "
                             "or damaged; save the layer's state dict again")
    if value["version"] > VERSION:
        raise InputError(f"{key} was saved by a newer foldc (record version {value['version']}, this one reads up to "
                         f"{VERSION}): upgrade foldc to load it")
    if value["packing"] != PACKING or value["dequantize"] != DEQUANTIZE:
        raise InputError(f"{key}: codes packed {value['packing']!r} and dequantized as {value['dequantize']!r}; this "
                         f"foldc reads {PACKING!r} and {DEQUANTIZE!r}: convert the weight with foldc.gemm.convert")
    try:
        record_encoding(value)
    except SpecError as e:
        raise InputError(f"{key}: the record's weight encoding {value['weight']!r} is not one foldc reads: {e}") \
            from None
    return value


def record_encoding(record: dict) -> GemmEncoding:
    """The weight's `GemmEncoding` a (checked) record names."""
    enc = parse_gemm_encoding(record["weight"], "weight")
    if enc is None:
        raise SpecError(f"weight={record['weight']!r} is a plain weight, which a FoldLinear does not hold")
    return enc


def describe(record: dict) -> str:
    """``k-group:4:128 over in_features=256 (out_features=32, act-order)``: a record as error messages name it."""
    order = ", act-order" if record["input_order"] else ""
    return f"{record['weight']} over in_features={record['in_features']} (out_features={record['out_features']}{order})"


def same_meaning(saved: dict, own: dict) -> bool:
    """Whether tensors saved under ``saved`` mean in a layer of ``own`` what they meant where they were saved: the
    same shape, input order and weight over its in_features (``per-channel:4`` is ``k-group:4:<in_features>``)."""
    if any(saved[f] != own[f] for f in ("in_features", "out_features", "input_order")):
        return False
    k = own["in_features"]
    return record_encoding(saved).affine(k) == record_encoding(own).affine(k)


def check_same_meaning(saved: dict, own: dict, key: str) -> None:
    """Refuse, naming both and the fix, a record ``saved`` whose tensors mean another weight in a layer of ``own``."""
    if same_meaning(saved, own):
        return
    raise InputError(
        f"{key}: the state dict holds a weight encoded as {describe(saved)} but this FoldLinear's is {describe(own)}: "
        "its tensors would compute another weight here. Build the layer as the checkpoint's: "
        f"FoldLinear.from_state_dict(state_dict) reads it from the state dict, or FoldLinear.from_linear(linear, "
        f"weight={saved['weight']!r}) (quantize_model(model, weight={saved['weight']!r}) for a whole model) before "
        "the load")
