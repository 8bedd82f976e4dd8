"""AttentionSpec: what the user declares about their decode attention and KV cache."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .encoding import Affine, parse_affine
from .errors import SpecError
from .options import as_int, check_int
from .registry import workload_of_table

#: the largest head counts and head size a spec may declare: every target allocates per head and
#: per channel (the Triton kernel pads query heads per KV head to a power of two of MMA rows);
#: real models stay far below (128 query heads, head_dim 576 at most)
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
ATTENTION_KEYS = ("heads", "head_dim", "k", "v")


@dataclass(frozen=True)
class AttentionSpec:
    """Decode attention (one query token per sequence) over a possibly quantized KV cache.

    Args:
        num_q_heads: query heads, 1 to MAX_HEADS (1024).
        num_kv_heads: KV heads; ``num_q_heads`` must be a multiple (GQA when larger than 1).
        head_dim: channels per head, 1 to MAX_HEAD_DIM (1024); the Triton attention kernel also needs a
            multiple of 16 whose 16-channel chunks (per bit field) each lie in one channel group
            (docs/backend.md), the register-operand kernel 64 to 256 (docs/register_operands.md).
        k, v: the Affine encoding of keys / values, or None for a plain fp16/bf16 operand.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    k: Affine | None = None
    v: Affine | None = None

    def __post_init__(self) -> None:
        heads, dim = (MAX_HEADS, "foldc.spec.MAX_HEADS"), (MAX_HEAD_DIM, "foldc.spec.MAX_HEAD_DIM")
        for field, (most, name) in (("num_q_heads", heads), ("num_kv_heads", heads), ("head_dim", dim)):
            # a NumPy or 0-dim torch integer (a size read from an array) is that int
            object.__setattr__(self, field, check_int(field, as_int(getattr(self, field)), 1, most, what=name))
        if self.num_q_heads % self.num_kv_heads:
            raise SpecError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "each KV head must serve the same number of query heads"
            )
        for field in ("k", "v"):
            enc = getattr(self, field)
            if enc is not None and not isinstance(enc, Affine):
                raise SpecError(f"{field}={enc!r} must be a foldc.Affine or None")
            if enc is not None:
                enc.check_head_dim(self.head_dim, field=f"head_dim (for {field})")

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (h_q in the cost model)."""
        return self.num_q_heads // self.num_kv_heads

    def describe(self) -> str:
        enc = lambda e: "plain" if e is None else e.short()  # noqa: E731
        return (f"heads {self.num_q_heads}/{self.num_kv_heads}, head_dim {self.head_dim}, "
                f"K {enc(self.k)}, V {enc(self.v)}")


def check_table_fields(table: dict, where: str) -> None:
    """Each field of an encoding written as a TOML table holds one value: the fields are joined into
    'layout:bits:group_size' text, where a ':' inside one (group_size = "128:fp32") would fill the next."""
    for field, value in table.items():
        if isinstance(value, (dict, list)) or ":" in str(value):
            raise SpecError(f"{where} {field}={value!r} must hold one value (a name or an integer, no ':'); give "
                            "each of layout/kind, bits, group_size and scale_dtype its own key")


def _parse_heads(text: str) -> tuple[int, int]:
    try:
        q, kv = (int(p) for p in str(text).split("/"))
    except ValueError:
        raise SpecError(f"heads={text!r} must look like 'Q/KV', e.g. '32/8'") from None
    return q, kv


def spec_from_args(k: str | None, v: str | None, heads: str, head_dim: int) -> AttentionSpec:
    """Build a spec from CLI-style strings: ``k='token:2:128'``, ``heads='32/8'`` ('none' = plain)."""
    q, kv = _parse_heads(heads)
    enc = lambda t: None if t in (None, "", "none", "plain") else parse_affine(t)  # noqa: E731
    if isinstance(head_dim, str):  # CLI text; anything else is checked as-is by AttentionSpec
        try:
            head_dim = int(head_dim)
        except ValueError:
            raise SpecError(f"head_dim={head_dim!r} must be a positive integer") from None
    return AttentionSpec(q, kv, head_dim, k=enc(k), v=enc(v))


def _attention_table(data: dict, path) -> dict:
    """The keys of an attention layout: the [attention] table, or the whole file without one. Next
    to an [attention] table nothing else may stand: a key above its header is top-level, not in it."""
    if "attention" not in data:
        return data
    table = data["attention"]
    if not isinstance(table, dict):
        raise SpecError(f"{path}: attention={table!r} must be a table: write [attention] on its own line, "
                        "then heads, head_dim, k, v below it")
    misplaced = sorted(key for key in data if key in ATTENTION_KEYS)
    if misplaced:
        raise SpecError(f"{path}: top-level key(s) {misplaced} stand above the [attention] header, outside the "
                        "table; move them below [attention]")
    extra = sorted(key for key in data if key != "attention" and key not in ATTENTION_KEYS)
    if extra:
        raise SpecError(f"{path}: unknown top-level key(s) or table(s) {extra}; an attention layout has only an "
                        "[attention] table (with heads, head_dim, k, v)")
    return table


def spec_from_toml(path: str | Path):
    """Read a spec from TOML: an `AttentionSpec` from::

        [attention]
        heads = "32/8"
        head_dim = 128
        k = "token:2:128"     # or a table: {layout = "token", bits = 2, group_size = 128}
        v = "channel:2:128"   # omit or "none" for a plain operand

    or a `foldc.GemmSpec` (y = x @ w.T) from::

        [gemm]
        m = 1                      # rows of x (tokens), or "symbolic"
        n = 4096                   # output channels
        k = 4096                   # reduced axis
        weight = "k-group:4:128"   # or "per-channel:8", or {kind = "k-group", bits = 4, group_size = 128}
        activation = "per-token:8" # optional: INT8 activations with zero points
    """
    try:
        # utf-8-sig: a file saved "UTF-8 with BOM" (Windows editors) is UTF-8 text; tomllib takes no mark
        data: dict[str, Any] = tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))
    except OSError as e:
        raise SpecError(f"cannot read layout file {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"layout file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
                        "save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"layout file {str(path)!r} is not valid TOML: {e}") from None
    sections = [key for key in data if key == "attention" or workload_of_table(key) is not None]
    if len(sections) > 1:
        tables = " and ".join(f"[{x}]" for x in sorted(sections))
        raise SpecError(f"{path}: has both {tables}; describe one operation per file")
    workload = workload_of_table(sections[0]) if sections else None
    if workload is not None:   # e.g. [gemm] (foldc/gemm/spec.py)
        name = workload.table
        extra = sorted(set(data) - {name})
        if extra:
            raise SpecError(f"{path}: unknown top-level keys {extra}; a {name} layout has only a [{name}] table")
        if not isinstance(data[name], dict):
            raise SpecError(f"{path}: {name} must be a table ([{name}]), got {data[name]!r}")
        return workload.from_table(data[name], where=f"{path}: [{name}]")
    table = _attention_table(data, path)
    unknown = set(table) - set(ATTENTION_KEYS)
    if unknown:
        raise SpecError(f"{path}: unknown keys {sorted(unknown)}; expected heads, head_dim, k, v")
    for key in ("heads", "head_dim"):
        if key not in table:
            raise SpecError(f"{path}: missing key {key!r} in [attention]")

    def enc(key: str) -> str | None:   # its errors get the file's name below
        val = table.get(key)
        if val == "":   # a template's unset value, not a plain operand (as the CLI refuses --k '')
            raise SpecError(f"{key}='' is empty: give an encoding such as token:2:128, 'none' for a plain operand, "
                            "or leave the key out")
        if isinstance(val, dict):
            bad = set(val) - {"layout", "bits", "group_size", "scale_dtype"}
            if bad:
                raise SpecError(f"[{key}] has unknown keys {sorted(bad)}")
            check_table_fields(val, f"[{key}]")
            try:
                text = f"{val['layout']}:{val['bits']}:{val['group_size']}"
            except KeyError as e:
                raise SpecError(f"[{key}] is missing {e.args[0]!r}") from None
            return text + (f":{val['scale_dtype']}" if "scale_dtype" in val else "")
        return val

    try:
        return spec_from_args(enc("k"), enc("v"), table["heads"], table["head_dim"])
    except SpecError as e:   # a value's own message, with the file it came from
        raise SpecError(f"{path}: [attention]: {e}") from None
