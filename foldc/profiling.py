"""Where a kernel's warps wait, by SASS opcode, from Nsight Compute's per-instruction table
(`ncu --import R.ncu-rep --page source --csv --print-source sass`, plain or gzipped): each stall
reason's share of the samples with the opcodes that carry most of it, the executed instruction mix,
and the excess shared-memory wavefronts (bank conflicts) by opcode. `benchmarks/ncu_stalls.py` prints
it for the files it is given (the ncu runs themselves: `benchmarks/ncu_one.py`)."""
from __future__ import annotations

import csv
import gzip
from collections import defaultdict


def opcode(source: str) -> str:
    """'@!P1 LDG.E.U16 R1, ...' -> 'LDG'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarize(path: str, top: int = 5) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Source" in r)
    cols = {name: i for i, name in enumerate(rows[header])}
    reasons = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    by_reason, by_op, executed, excess = defaultdict(float), defaultdict(lambda: defaultdict(float)), \
        defaultdict(float), defaultdict(float)

    def num(row, name):
        try:
            return float(row[cols[name]] or 0)
        except (KeyError, ValueError, IndexError):
            return 0.0
    samples = 0.0
    for row in rows[header + 1:]:
        if len(row) < len(cols):
            continue
        op = opcode(row[cols["Source"]].strip())
        samples += num(row, "Warp Stall Sampling (All Samples)")
        executed[op] += num(row, "Instructions Executed")
        excess[op] += num(row, "L1 Wavefronts Shared Excessive")
        for reason in reasons:
            by_reason[reason] += num(row, reason)
            by_op[reason][op] += num(row, reason)
    if not samples:
        return f"{path}: no stall samples"
    lines = [f"{path}: {samples:.0f} samples"]
    for reason, value in sorted(by_reason.items(), key=lambda x: -x[1])[:10]:
        tops = sorted(by_op[reason].items(), key=lambda x: -x[1])[:top]
        lines.append(f"{reason:22s} {value / samples:6.1%}   " + ", ".join(f"{o} {v / samples:.1%}" for o, v in tops))
    total = sum(executed.values()) or 1.0
    lines.append("executed: " + ", ".join(f"{o} {v / total:.1%}" for o, v in
                                           sorted(executed.items(), key=lambda x: -x[1])[:16]))
    lines.append("excess shared wavefronts: " + ", ".join(f"{o} {v:.0f}" for o, v in excess.items() if v))
    return "\n".join(lines)
