"""Instruction counts of a compiled kernel's inner loop, from its cubin (no GPU needed).

The token loop is the one backward branch whose body holds the tensor-core instructions
(HMMA / HGMMA / UTCHMMA). Counting the SASS instructions between its target and the branch
gives the warp-instructions one warp issues per token tile; times 32 lanes and the number of
warps, over the bytes one tile reads, that is the lane-slots per byte the cost model (eq. 13)
estimates.
"""
from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*([^;]*);")
MMA_OPS = ("HMMA", "HGMMA", "UTCHMMA", "UTCQMMA", "IMMA")


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name} not found in the triton wheel ({path})")
    return str(path)


def disassemble(cubin: Path) -> list[tuple[int, str, str]]:
    """[(address, opcode, operands)] of every instruction in the cubin."""
    text = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    out = []
    for m in _LINE.finditer(text):
        out.append((int(m.group(1), 16), m.group(3), m.group(5)))
    return out


def loop_instructions(cubin: Path) -> list[tuple[int, str, str]]:
    """[(address, opcode, operands)] of the loop that holds the matrix instructions (the token loop)."""
    insts = disassemble(cubin)
    best = None
    for addr, op, args in insts:
        if op != "BRA":
            continue
        target = re.search(r"0x([0-9a-f]+)", args)
        if not target:
            continue
        start = int(target.group(1), 16)
        if start >= addr:
            continue
        body = [i for i in insts if start <= i[0] <= addr]
        if any(o in MMA_OPS for _, o, _ in body) and (best is None or len(body) > len(best)):
            best = body
    if best is None:
        raise ValueError(f"{cubin}: no loop with matrix instructions found")
    return best


def inner_loop(cubin: Path) -> Counter:
    """Opcode counts of the loop that holds the matrix instructions (the token loop)."""
    return Counter(o for _, o, _ in loop_instructions(cubin))


def skipped_addresses(loop: list[tuple[int, str, str]]) -> set[int]:
    """Addresses of ``loop`` that a forward branch inside it jumps over: work some iterations
    skip, such as the reload once per channel-wise token group (the rest runs every tile)."""
    end = loop[-1][0]
    skipped: set[int] = set()
    for addr, op, args in loop[:-1]:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and addr < int(target.group(1), 16) <= end:
            skipped.update(a for a, _, _ in loop if addr < a < int(target.group(1), 16))
    return skipped


def lane_slots_per_byte(counts: Counter, num_warps: int, bytes_per_tile: float) -> float:
    return sum(counts.values()) * 32 * num_warps / bytes_per_tile
