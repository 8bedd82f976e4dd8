"""Which specs the register-operand kernel lowers, on the CPU (no GPU, no compilation): K and V each
plain or in {token, channel} x {2, 4, 8} bits x groups {32, 64, 128} (and channel-wise 16), over
several GQA ratios and head_dims; prints how many lower and the refusals by reason (docs/perf.md).

    python3 benchmarks/lowering_survey.py
"""
from __future__ import annotations

import collections
import itertools

import foldc
from foldc.backends.gluon.lower import lowerable
from foldc.errors import FoldError

HEADS = ((8, 8), (32, 8), (40, 8), (56, 8), (64, 4), (64, 2), (48, 2), (34, 2), (62, 2), (18, 2))   # 17, 31, 9: ragged
HEAD_DIMS = (64, 96, 128, 160, 192, 256)


def encodings():
    yield None   # a plain side
    for bits in (2, 4, 8):
        for layout in ("token", "channel"):
            for group in (16, 32, 64, 128):
                if layout == "token" and group == 16:
                    continue   # token-wise groups of 32 channels and up
                yield foldc.Affine(bits, layout, group)


def main() -> int:
    total = lowered = 0
    refused: collections.Counter = collections.Counter()
    for head_dim in HEAD_DIMS:
        for heads in HEADS:
            for k, v in itertools.product(list(encodings()), repeat=2):
                if k is None and v is None:
                    continue
                try:
                    spec = foldc.AttentionSpec(*heads, head_dim, k, v)
                except FoldError:   # e.g. groups of 128 channels on head_dim 96
                    continue
                total += 1
                ok, why = lowerable(spec)
                if ok:
                    lowered += 1
                else:
                    refused[(head_dim, why.split(";")[0])] += 1
    print(f"{lowered} of {total} specs lower to the register-operand kernel")
    for (head_dim, why), n in refused.most_common():
        print(f"{n:6d}  head_dim {head_dim}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
