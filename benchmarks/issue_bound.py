"""How far each layout of the grid can go with the register-operand kernel as it is: its SASS count per tile
(ahead-of-time builds, docs/results/grid_aot_full.json) turned into the time the H200's schedulers need to
issue it, set beside the time it took (docs/results/layout_grid_h200.json), for every layout (CPU, no GPU).

    python3 benchmarks/issue_bound.py [--out issue_bound.json]

The issue floor of a call: every program's tiles x the build's warp-instructions per tile, issued at one
warp-instruction per cycle by each of the 132 SMs' 4 schedulers at CLOCK_GHZ (the clock the SMs ran under load).
A kernel that keeps its schedulers busy a fraction e of the time takes floor / e; one bound by memory takes
bytes / (the read ceiling x a fraction b). The model's time is the larger of the two; e (the median of time /
floor over the timed layouts reading below BANDWIDTH_BOUND of the ceiling) and b (the best fraction any
timed layout reached) come from the timed run. It predicts each layout of the full grid (394 layouts, each
side quantized or plain) at 8 x 64K and lists those it puts below 60% of the ceiling: a layout whose issue floor
alone exceeds 60% of the ceiling's time needs fewer instructions per byte, not a better schedule.
Layouts that run the warpgroup template (32 query rows per KV head, token-wise INT2 g128) are left out: its
SASS is not in the grid's builds.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
SMS, SCHEDULERS, CLOCK_GHZ = 132, 4, 1.755
BANDWIDTH_BOUND = 80.0   # % of the ceiling above which a timed layout counts as bound by memory
TARGET = 60.0


def issue_floor_us(build: dict, lay, batch: int, tokens: int) -> float:
    """µs the schedulers need to issue every tile of a (batch x tokens) call of ``lay``'s build."""
    from foldc.backends.gluon.lower import gluon_plan, lower

    cfg = lower(gluon_plan(lay.spec()))
    programs = batch * (lay.kv_heads // build["pack_heads"]) * cfg.row_blocks
    tiles = programs * math.ceil(tokens / build["block_n"])
    return tiles * build["instructions_per_tile"] / (SMS * SCHEDULERS * CLOCK_GHZ * 1e3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aot", default=str(RESULTS / "grid_aot_full.json"))
    ap.add_argument("--timed", default=str(RESULTS / "layout_grid_h200.json"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from foldc.backends.gluon.warpgroup_launch import warpgroup_applies
    from foldc.bench_layouts import must_read
    from foldc.layout_grid import grid

    builds = {r["label"]: r for r in json.loads(Path(args.aot).read_text())["rows"]
              if r["arch"] == "sm_90" and r["status"] == "ok"}
    timed = json.loads(Path(args.timed).read_text())
    ceiling = timed["ceiling_tb_s"] * 1e12
    layouts = {lay.label: lay for lay in grid("full")}
    batch, tokens = timed["time_shapes"][0]

    def bandwidth_us(lay) -> float:
        return must_read(lay, batch, tokens) / ceiling * 1e6

    seen = []
    for row in timed["rows"]:
        lay = layouts.get(row["label"])
        t = next(t for t in row["timings"] if (t["batch"], t["tokens"]) == (batch, tokens))
        if lay is None or row["label"] not in builds or warpgroup_applies(lay.spec(), "sm_90"):
            continue
        floor = issue_floor_us(builds[row["label"]], lay, batch, tokens)
        seen.append(dict(label=row["label"], us=t["us"], pct=t["pct_ceiling"], floor_us=floor,
                         bandwidth_us=bandwidth_us(lay)))
    efficiency = statistics.median(r["floor_us"] / r["us"] for r in seen if r["pct"] < BANDWIDTH_BOUND)
    best = max(r["pct"] for r in seen) / 100

    def predict(floor: float, bw: float) -> float:
        return max(floor / efficiency, bw / best)

    for r in seen:
        r["model_us"] = predict(r["floor_us"], r["bandwidth_us"])
        r["model_error"] = r["model_us"] / r["us"] - 1
    errors = [abs(r["model_error"]) for r in seen]
    print(f"issue efficiency e = {efficiency:.3f} (median over {sum(r['pct'] < BANDWIDTH_BOUND for r in seen)} "
          f"timed layouts below {BANDWIDTH_BOUND:.0f}%), best bandwidth fraction b = {best:.3f}")
    print(f"model against the {len(seen)} timed layouts: median error {100 * statistics.median(errors):.1f}%, "
          f"largest {100 * max(errors):.1f}%")
    for r in sorted(seen, key=lambda r: r["model_error"]):
        print(f"  {r['label']:48s} {r['us']:7.1f} µs measured, {r['model_us']:7.1f} model "
              f"({100 * r['model_error']:+.0f}%), issue floor {r['floor_us']:6.1f}")

    predicted = []
    for label, lay in layouts.items():
        build = builds.get(label)
        if build is None or warpgroup_applies(lay.spec(), "sm_90"):
            continue
        floor, bw = issue_floor_us(build, lay, batch, tokens), bandwidth_us(lay)
        us = predict(floor, bw)
        predicted.append(dict(label=label, model_us=us, model_pct=100 * bw / us, floor_pct=100 * bw / floor,
                              floor_us=floor, bandwidth_us=bw))
    below = sorted((p for p in predicted if p["model_pct"] < TARGET), key=lambda p: p["model_pct"])
    print(f"full grid: {len(predicted)} layouts modelled at {batch} x {tokens}; {len(below)} below {TARGET:.0f}% of "
          f"the ceiling, of which {sum(p['floor_pct'] < TARGET for p in below)} even at e = 1")
    for p in below:
        print(f"  {p['label']:48s} {p['model_pct']:5.1f}% (issue floor alone {p['floor_pct']:5.1f}%)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(clock_ghz=CLOCK_GHZ, efficiency=efficiency, best_bandwidth=best,
                                                  shape=[batch, tokens], timed=seen, predicted=predicted),
                                             indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
