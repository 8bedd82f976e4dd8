"""Host time of a bound launch with a stand-in driver (CPU, no GPU): foldc's C launcher (`fast_c`) against
triton's generated launcher called with the same launch, both into a libcuda whose cuLaunchKernelEx records and
returns (tests/backends/stub_cuda.c). What the real driver adds is the same for both. Evidence for docs/perf.md,
not a test.

    python3 benchmarks/launch_host_stub.py [--out launch_host_stub.json]

The launches have the decode kernel's parameters (14 tensors, 12 integers, a float, the token count given per
call) and the merge kernel's (5 tensors, 4 integers). Rows: triton's launcher given the arguments as a bound
launch gave them until foldc had its own (the checks in Python: alignment, device, hooks, the token count's
range); foldc's `Launch` called alone; `fast_launch.Bound` (the hooks and device in Python, the rest in C); a
decode and its merge as two `Bound` calls or one `Bound.then` (one check of the hooks, knobs and device for both).
Each figure the median over 15 repeats of the mean of 20000 calls, µs.
"""
from __future__ import annotations

import argparse
import functools
import json
import operator
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECODE = ["*i32"] * 7 + ["*fp32"] * 7 + ["i32"] * 12 + ["fp32", "i32", "constexpr", "constexpr"]
MERGE = ["*fp32"] * 3 + ["*bf16", "*fp32"] + ["i32"] * 4 + ["constexpr"]
_I32 = 1 << 31


def _triton_bound(direct, grid, head, metadata, rest, around, device, current_device, stream, knobs):
    """A bound launch through triton's launcher, as `fast_launch.Bound.__call__` made it before foldc's own."""
    def call(addresses, values=()):
        if functools.reduce(operator.or_, addresses) & 15 or current_device() != device:
            return False
        runtime = knobs.runtime
        if (getattr(runtime.launch_enter_hook, "calls", True) or getattr(runtime.launch_exit_hook, "calls", True)
                or (runtime.debug, knobs.compilation.instrumentation_mode) != (False, "")):
            return False
        if around is not None:
            (value,) = values
            if not -_I32 <= value < _I32:
                return False
            direct(grid[0], grid[1], grid[2], stream(device), 0x5EED, *head, metadata, None, None, None, *addresses,
                   *around[0], value, *around[1])
        else:
            direct(grid[0], grid[1], grid[2], stream(device), 0x5EED, *head, metadata, None, None, None, *addresses,
                   *rest)
        return True
    return call


def mean_us(fn, number: int = 20000, repeat: int = 15) -> float:
    return statistics.median(t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=repeat))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "backends"))
    from _stub_cuda import build_stub
    from triton import knobs
    from triton.backends.nvidia.driver import include_dirs, make_launcher
    from triton.runtime.build import compile_module_from_src

    from foldc.backends.runtime import fast_c, fast_launch

    stub = build_stub(Path(tempfile.mkdtemp()))
    built = fast_c.module()
    assert built is not None, fast_c._failed
    fast_launch._CURRENT_DEVICE = lambda: 0
    fast_launch._RAW_STREAM = lambda device: 7
    rows, held = {}, {}
    for name, signature, grid in (("decode", DECODE, (32, 8, 1)), ("merge", MERGE, (8, 1, 1))):
        tensors = sum(t.startswith("*") for t in signature)
        values = [0] * tensors + [16 * (i + 3) for i in range(len(signature) - tensors - 2)] + [16, None]
        if name == "decode":
            values[-4] = 0.125
        slot = len(signature) - 3 if name == "decode" else -1
        src = make_launcher({}, {f"a{i}": t for i, t in enumerate(signature)}, None)
        direct = compile_module_from_src(src, "__triton_launcher", library_dirs=[str(stub.path.parent)],
                                         include_dirs=include_dirs, libraries=["libcuda.so.1"]).launch
        rest = tuple(values[tensors:])
        around = None if slot < 0 else (rest[:slot - tensors], rest[slot - tensors + 1:])
        triton_bound = _triton_bound(direct, grid, (False, False, None, None), (1, 1, 4096), rest, around, 0,
                                     fast_launch._CURRENT_DEVICE, fast_launch._RAW_STREAM, knobs)
        packed, slot_index = fast_c.packed_parameters(signature, tuple(values), tensors, slot)
        launch = built.Launch(0x5EED, *grid, 32, 4096, False, False, packed, tensors, slot_index)
        bound = fast_launch.Bound(launch, 0)
        addresses = tuple(0x7F0000000000 + 256 * i for i in range(tensors))
        per_call = (16384,) if slot >= 0 else ()
        assert triton_bound(addresses, per_call) and launch(7, *addresses, *per_call) and bound(addresses, per_call)
        rows[name] = {
            "triton's launcher as bound until now": mean_us(lambda: triton_bound(addresses, per_call)),
            "foldc Launch alone": mean_us(lambda: launch(7, *addresses, *per_call)),
            "fast_launch.Bound (foldc Launch)": mean_us(lambda: bound(addresses, per_call)),
        }
        held[name] = (bound, addresses, per_call)
    # a decode and its merge, as an eager call launches them: two Bound calls, or one check for both (Bound.then)
    (decode, da, dv), (merge, ma, _) = held["decode"], held["merge"]
    assert decode.then(da, dv, merge, ma) == 2
    rows["decode + merge"] = {
        "two fast_launch.Bound calls": mean_us(lambda: decode(da, dv) and merge(ma)),
        "fast_launch.Bound.then": mean_us(lambda: decode.then(da, dv, merge, ma)),
    }
    for name, row in rows.items():
        for label, us in row.items():
            print(f"{name:7s} {label:40s} {us:6.3f} µs")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": "CPU, stand-in libcuda", "python": sys.version.split()[0],
                                              "rows_us": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
