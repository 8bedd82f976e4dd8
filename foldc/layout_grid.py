"""The K/V layout grid of `foldc bench --layouts` (foldc/bench_layouts.py), as data: every layout the product
serves (K and V each token- or channel-wise at 2, 4 or 8 bits in groups of 32, 64 or 128, a plain side, scale
dtypes, query heads per KV head, head_dims, the lowerings past one tile per group), the ``quick`` and ``timed``
subsets and what the timed subset must cover. The AOT grid (benchmarks/grid_aot.py), the SASS model
(benchmarks/issue_bound.py) and the lowering tests walk the same rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .encoding import Affine, parse_affine


SIDE_LAYOUTS = ("token", "channel")
BITS = (2, 4, 8)
GROUPS = (32, 64, 128)
#: query heads / KV heads for each GQA ratio: 8 KV heads up to 8 query heads per KV head, fewer
#: above it so that no layout has more than 64 query heads; 17 splits into row blocks of 9 and 8
GQA_HEADS = {1: (8, 8), 4: (32, 8), 5: (40, 8), 7: (56, 8), 8: (64, 8), 16: (64, 4), 17: (34, 2), 32: (64, 2)}
HEAD_DIMS = (64, 128, 256)
BASE_HEADS, BASE_HEAD_DIM = GQA_HEADS[4], 128   # every layout not said otherwise: 32/8 heads, head_dim 128
PLAIN = "plain"

#: beyond the K x V product at 32/8 heads, head_dim 128: (k, v, query heads, KV heads, head_dim)
SCALE_DTYPE_EXTRAS = (
    ("token:2:128:bf16", "token:2:128:bf16"), ("token:2:128:fp32", "token:2:128:fp32"),
    ("token:4:128:bf16", "channel:4:128:bf16"), ("channel:4:64:fp32", "token:4:64:fp32"),
    ("channel:2:128:fp32", "channel:2:128:bf16"), ("token:8:32:fp32", "channel:8:32:fp32"),
)
GQA_EXTRAS = tuple((k, v, *GQA_HEADS[ratio], BASE_HEAD_DIM)
                   for ratio in GQA_HEADS if ratio != 4
                   for k, v in (("token:2:128", "token:2:128"), ("channel:4:64", "token:4:64")))
HEAD_DIM_EXTRAS = (
    ("token:2:32", "token:2:32", *BASE_HEADS, 64), ("token:2:64", "token:2:64", *BASE_HEADS, 64),
    ("token:2:128", "token:2:128", *BASE_HEADS, 64),          # refused: a group of 128 cannot cut 64 channels
    ("channel:2:128", "channel:2:128", *BASE_HEADS, 64), ("token:4:64", "channel:4:64", *BASE_HEADS, 64),
    ("token:2:128", "token:2:128", *BASE_HEADS, 256), ("token:2:64", "token:2:64", *BASE_HEADS, 256),
    ("token:4:128", "channel:4:128", *BASE_HEADS, 256), ("channel:2:128", "token:2:128", *BASE_HEADS, 256),
)

#: the lowerings past one tile per group and powers of two: channel-wise groups of 16 tokens (two per
#: tile), dequant plans (groups of at most twice the 16 rows of a program, eq. 12) and head_dim 96
#: (padded to 128 in the registers)
FEATURE_EXTRAS = (
    ("channel:2:16", "token:2:128", *BASE_HEADS, BASE_HEAD_DIM), ("token:4:128", "channel:4:16", *BASE_HEADS, 128),
    ("channel:2:16", "channel:2:16", *BASE_HEADS, BASE_HEAD_DIM),
    ("token:2:32", "token:2:32", *GQA_HEADS[16], BASE_HEAD_DIM), ("channel:2:32", "channel:4:32", *GQA_HEADS[16], 128),
    ("token:4:96", "token:4:96", *BASE_HEADS, 96), ("token:2:96", "channel:2:32", *BASE_HEADS, 96),
)

#: ~6 layouts: the four layouts of the explainer at INT2, INT4 token-wise and one plain side
QUICK = (
    ("token:2:128", "token:2:128"), ("token:2:128", "channel:2:128"), ("channel:2:128", "token:2:128"),
    ("channel:2:128", "channel:2:128"), ("token:4:128", "token:4:128"), ("token:4:128", PLAIN),
)

#: the representative subset (every entry is in the full grid; `uncovered` checks the axes)
TIMED = (
    ("token:2:128", "token:2:128"), ("token:4:128", "token:4:128"), ("token:8:128", "token:8:128"),
    ("token:2:128", "channel:2:128"), ("channel:2:128", "token:2:128"), ("channel:2:128", "channel:2:128"),
    ("token:2:64", "token:2:64"), ("token:2:32", "token:2:32"), ("channel:4:64", "channel:4:64"),
    ("token:4:128", "token:2:128"), ("token:8:128", "token:4:128"), ("channel:8:32", "token:2:32"),
    ("token:2:64", "channel:8:64"), ("token:2:128", "token:2:64"), ("token:4:32", "token:4:32"),
    ("token:8:32", "token:8:64"), ("token:2:128", PLAIN), (PLAIN, "token:2:128"),
    ("token:2:128:bf16", "token:2:128:bf16"), ("token:2:128:fp32", "token:2:128:fp32"),
    ("channel:4:64:fp32", "token:4:64:fp32"),
    ("token:2:128", "token:2:128", *GQA_HEADS[1], 128), ("token:2:128", "token:2:128", *GQA_HEADS[5], 128),
    ("token:2:128", "token:2:128", *GQA_HEADS[7], 128), ("token:2:128", "token:2:128", *GQA_HEADS[8], 128),
    ("token:2:128", "token:2:128", *GQA_HEADS[16], 128), ("token:2:128", "token:2:128", *GQA_HEADS[32], 128),
    ("channel:4:64", "token:4:64", *GQA_HEADS[16], 128), ("token:2:128", "token:2:128", *GQA_HEADS[17], 128),
    ("token:2:64", "token:2:64", *BASE_HEADS, 64), ("token:2:128", "token:2:128", *BASE_HEADS, 256),
    ("token:4:128", "channel:4:128", *BASE_HEADS, 256),
    ("channel:2:16", "token:2:128"), ("token:2:32", "token:2:32", *GQA_HEADS[16], 128),
    ("token:4:96", "token:4:96", *BASE_HEADS, 96),
)

#: what the timed subset must cover (`uncovered`): each side's bits and layouts, both groups of
#: sizes, mixed widths, a plain side each way, each scale dtype, every GQA ratio and head_dim
TIMED_MUST_COVER = {
    "k bits": set(BITS), "v bits": set(BITS), "k layout": set(SIDE_LAYOUTS) | {PLAIN},
    "v layout": set(SIDE_LAYOUTS) | {PLAIN}, "group size": set(GROUPS), "mixed bits": {True},
    "scale dtype": {"fp16", "bf16", "fp32"}, "gqa ratio": set(GQA_HEADS), "head_dim": set(HEAD_DIMS),
}


@dataclass(frozen=True)
class Layout:
    """One row of the grid: K and V encodings (None: a plain bf16/fp16 side), heads and head_dim."""

    k: Affine | None
    v: Affine | None
    q_heads: int = BASE_HEADS[0]
    kv_heads: int = BASE_HEADS[1]
    head_dim: int = BASE_HEAD_DIM

    @property
    def label(self) -> str:
        """``K token:2:128 V channel:2:128 32/8 d128``: what ``--only`` matches."""
        return f"K {side_text(self.k)} V {side_text(self.v)} {self.q_heads}/{self.kv_heads} d{self.head_dim}"

    @property
    def gqa(self) -> int:
        return self.q_heads // self.kv_heads

    def spec(self):
        """The AttentionSpec; raises SpecError where the encodings do not fit head_dim."""
        from .spec import AttentionSpec

        return AttentionSpec(self.q_heads, self.kv_heads, self.head_dim, k=self.k, v=self.v)

    def describe(self) -> dict:
        return {"label": self.label, "k": side_text(self.k), "v": side_text(self.v), "q_heads": self.q_heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim}


def side_text(enc: Affine | None) -> str:
    return PLAIN if enc is None else enc.short()


def layout(k: str, v: str, q_heads: int = BASE_HEADS[0], kv_heads: int = BASE_HEADS[1],
           head_dim: int = BASE_HEAD_DIM) -> Layout:
    """A Layout from the CLI's encoding text (``token:2:128[:bf16]`` or ``plain``)."""
    enc = lambda text: None if text == PLAIN else parse_affine(text)  # noqa: E731
    return Layout(enc(k), enc(v), q_heads, kv_heads, head_dim)


def side_encodings() -> list[str]:
    """Every quantized side of the product: {token, channel} x bits {2, 4, 8} x groups {32, 64, 128}."""
    return [f"{lay}:{bits}:{group}" for lay in SIDE_LAYOUTS for bits in BITS for group in GROUPS]


def full_grid() -> list[Layout]:
    """K x V over `side_encodings` (mixed widths and group sizes included), each side quantized
    with the other plain, then the scale-dtype, GQA, head_dim and feature extras; in that order."""
    sides = side_encodings()
    rows = [layout(k, v) for k in sides for v in sides]
    rows += [layout(k, PLAIN) for k in sides] + [layout(PLAIN, v) for v in sides]
    rows += [layout(*extra) for extra in SCALE_DTYPE_EXTRAS + GQA_EXTRAS + HEAD_DIM_EXTRAS + FEATURE_EXTRAS]
    return list(dict.fromkeys(rows))


def grid(name: str) -> list[Layout]:
    """The layouts of ``quick``, ``timed`` or ``full``."""
    if name == "full":
        return full_grid()
    return [layout(*row) for row in {"quick": QUICK, "timed": TIMED}[name]]


def axes(layouts) -> dict[str, set]:
    """The values each axis of the grid takes over ``layouts`` (keys as in TIMED_MUST_COVER)."""
    dtype_name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    seen: dict[str, set] = {key: set() for key in TIMED_MUST_COVER}
    for lay in layouts:
        for name, enc in (("k", lay.k), ("v", lay.v)):
            seen[f"{name} layout"].add(PLAIN if enc is None else enc.layout)
            if enc is not None:
                seen[f"{name} bits"].add(enc.bits)
                seen["group size"].add(enc.group_size)
                seen["scale dtype"].add(dtype_name[enc.scale_dtype])
        if lay.k is not None and lay.v is not None:
            seen["mixed bits"].add(lay.k.bits != lay.v.bits)
        seen["gqa ratio"].add(lay.gqa)
        seen["head_dim"].add(lay.head_dim)
    return seen


def uncovered(layouts, must=None) -> dict[str, set]:
    """Axis -> the values of ``must`` (default TIMED_MUST_COVER) that no layout takes; empty if covered."""
    seen = axes(layouts)
    missing = {key: set(values) - seen.get(key, set()) for key, values in (must or TIMED_MUST_COVER).items()}
    return {key: values for key, values in missing.items() if values}


def selects(wanted: str, label: str, labels) -> bool:
    """An ``--only`` item picks the layout of exactly that label if there is one, else every layout
    whose label contains it (as `foldc.bench.selects` does for ``--kernels``)."""
    return label == wanted if wanted in labels else wanted in label


def pick(layouts, wanted) -> list[Layout]:
    labels = {lay.label for lay in layouts}
    return [lay for lay in layouts if not wanted or any(selects(w, lay.label, labels) for w in wanted)]
