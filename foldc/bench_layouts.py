"""`foldc bench --layouts`: the K/V layout grid, checked against float64 and timed on one GPU, in one run.

For every layout of a grid (K and V encodings, query / KV heads, head_dim) it builds the
`AttentionSpec`, compiles it with ``foldc.compile(spec, target="auto")`` and default options
(no tuning cache: `without_tuning_cache`), and

- checks it: fresh random inputs (`foldc.testing.run_case`: never zeros, outlier key channels,
  ragged sequence lengths, a NaN-poisoned ``out=``) with bf16 and with fp16 queries, the relative
  L2 error against float64 attention over the same dequantized cache, and that error over the
  error of plain attention in the plan's bar dtype (`foldc.testing.plain_attention`: the query's
  dtype, or bf16 where the plan holds fp16 queries to plain bf16 attention's error, as the
  register-operand kernel does). The bar (docs/derivation.md, eq. 6a; `foldc.precision.TARGET`) is
  at most 2x that, as the tests hold it;
- times it (bf16 queries, `foldc.bench.timed`: triton's do_bench, L2 flushed, the better of eager
  launches and CUDA-graph replay, both kept in the JSON) at each timed shape, beside torch SDPA
  with the cuDNN backend (bf16 cache, enable_gqa) on the same heads and shape, and the HBM read
  ceiling of the run: the faster of a streaming read measured once (`foldc.bench.stream_read_ceiling`) and
  the fastest must-read rate of any timing of the same run, cuDNN's or a layout's (`foldc.bench.run_ceiling`:
  cuDNN read at 101-104% of the streaming read at 8 x 64K, so that read alone is no ceiling).

Per layout it reports the kernel that ran each query dtype (``type(attn).__name__``), µs, % of the
ceiling on the bytes the kernel must read (codes + scales + zeros + query + output, `must_read`), the speed-up over cuDNN, "x ideal" (that
speed-up over the byte ratio of a bf16 cache to this layout's, `speed`), the errors and the bar.
A layout that foldc refuses (a `foldc.FoldError`, e.g. a token-wise group that does not divide
head_dim) is listed as refused with its message.

Grids (foldc/layout_grid.py): ``quick`` (6 layouts), ``timed`` (a representative subset that covers every
axis of the full grid, timed at 8 x 64K and checked at 2 x 16K) and ``full`` (every layout, checked
at 2 x 4K; timed too with ``--time-all``). ``--check-only --target interpret`` runs the checks
alone on the CPU under Triton's interpreter (fp16 queries, tiny shapes): foldc's launcher switches
Triton into interpreter mode itself (foldc/backends/runtime/modules.py, ``interpreter``).

Writes ``layouts.json`` (after every layout, so a run cut short keeps what it measured) and
``layouts.txt`` (the table) under the output folder. Exit status: 0 when every layout that was not
refused meets the bar, 1 otherwise, 2 without a GPU (unless ``--check-only --target interpret``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from . import bench
from .encoding import Affine, scale_shape
from .errors import FoldError
from .layout_grid import Layout, grid, pick
from .precision import TARGET

# ---------------------------------------------------------------------------------------------
# where and how the grid runs
# ---------------------------------------------------------------------------------------------

#: (batch, tokens) per grid: where the layouts are checked and where they are timed
CHECK_SHAPES = {"quick": (2, 4096), "timed": (2, 16384), "full": (2, 4096)}
INTERPRET_CHECK_SHAPE = (2, 80)   # Triton's interpreter runs programs one after another on the CPU
TIME_SHAPES = ((8, 65536),)
#: absolute slack on the bar for errors at the level of float64 noise (tests/test_precision.py's FLOOR)
ERROR_FLOOR = 1e-5
QUERY_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------
# bytes and speed
# ---------------------------------------------------------------------------------------------

def side_bytes(enc: Affine | None, batch: int, heads: int, tokens: int, head_dim: int) -> int:
    """Bytes of one cache side: codes plus a scale and a zero per group (`scale_shape`: a partial last
    channel-wise group counts whole), or bf16 values for a plain side."""
    values = batch * heads * tokens * head_dim
    if enc is None:
        return 2 * values
    params = math.prod(scale_shape(enc, batch, heads, tokens, head_dim))
    return values * enc.bits // 8 + 2 * params * torch.empty((), dtype=enc.scale_dtype).element_size()


def must_read(lay: Layout, batch: int, tokens: int) -> int:
    """Bytes a decode kernel must move for ``lay``: both cache sides, the query and the output
    (bf16); `foldc.bench.must_read` for any heads and head_dim."""
    cache = sum(side_bytes(enc, batch, lay.kv_heads, tokens, lay.head_dim) for enc in (lay.k, lay.v))
    return cache + 2 * 2 * batch * lay.q_heads * lay.head_dim


def bf16_bytes(lay: Layout, batch: int, tokens: int) -> int:
    """`must_read` of the same heads and shape with a plain bf16 cache (what cuDNN reads)."""
    return must_read(Layout(None, None, lay.q_heads, lay.kv_heads, lay.head_dim), batch, tokens)


def speed(lay: Layout, batch: int, tokens: int, us: float, cudnn_us: float | None, ceiling: float) -> dict:
    """The figures of one timing. ``pct_ceiling``: bytes read per second over the ceiling (bytes/s).
    ``ideal``: bf16 bytes over this layout's, the speed-up a purely bandwidth-bound kernel would get
    from the smaller cache. ``x_cudnn``: cuDNN µs over ours. ``x_ideal``: x_cudnn over ideal, i.e. our
    bandwidth over cuDNN's (1.0: the kernel speeds up exactly as much as its bytes shrink)."""
    nbytes, plain = must_read(lay, batch, tokens), bf16_bytes(lay, batch, tokens)
    ideal = plain / nbytes
    x_cudnn = cudnn_us / us if cudnn_us else math.nan
    return {"bytes": nbytes, "bf16_bytes": plain, "pct_ceiling": 100 * nbytes / (us * 1e-6) / ceiling,
            "ideal": ideal, "x_cudnn": x_cudnn, "x_ideal": x_cudnn / ideal}


# ---------------------------------------------------------------------------------------------
# running one layout
# ---------------------------------------------------------------------------------------------

@contextmanager
def without_tuning_cache():
    """Default launch options for every kernel compiled inside: the tuning cache (autotune.json
    under $FOLDC_CACHE_DIR, looked up by TritonAttention and GluonAttention for options left unset)
    is pointed at an empty temporary folder for the duration. Generated kernel modules are written
    there too (they are regenerated, which costs milliseconds)."""
    old = os.environ.get("FOLDC_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="foldc_layouts_") as folder:
        os.environ["FOLDC_CACHE_DIR"] = folder
        try:
            yield folder
        finally:
            if old is None:
                os.environ.pop("FOLDC_CACHE_DIR", None)
            else:
                os.environ["FOLDC_CACHE_DIR"] = old


def message(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:240] if lines else ''}"


def plan_of_kernel(kernel, dtype: torch.dtype):
    """The plan ``dtype`` queries run on ``kernel``, where it says (else None)."""
    if hasattr(kernel, "plan_for"):
        return kernel.plan_for(dtype)
    return getattr(kernel, "plan", None)


def folds_of(kernel, dtype: torch.dtype) -> dict | None:
    """The plan's folds ({"qk": ..., "pv": ...}) of the kernel that ran, where it says."""
    the_plan = plan_of_kernel(kernel, dtype)
    return dict(the_plan.folds) if the_plan is not None else None


def meets_bar(check: dict) -> bool:
    """Every output written and the error within TARGET (2) x the bar's: plain attention's in the plan's
    bar dtype (``bar_error``; the query's dtype where the row has none, ``plain_error``)."""
    bar = check.get("bar_error", check["plain_error"])
    return check["unwritten"] == 0 and check["error"] <= TARGET * bar + ERROR_FLOOR


def check(attn, spec, dtype: torch.dtype, shape: tuple[int, int], device: str, seed: int) -> dict:
    """One `foldc.testing.run_case` (fresh inputs, ragged lengths, NaN-poisoned out) as a dict."""
    from .testing import run_case

    batch, tokens = shape
    r = run_case(attn, spec, batch, tokens, dtype, device, seed)
    the_plan = plan_of_kernel(attn, dtype)
    bar_dtype = getattr(the_plan, "bar_dtype", None) or ("bf16" if dtype == torch.bfloat16 else "fp16")
    bar_error = r.plain_bf16_error if bar_dtype == "bf16" else r.plain_error
    row = {"batch": batch, "tokens": tokens, "kernel": type(attn).__name__, "folds": folds_of(attn, dtype),
           "error": r.error, "plain_error": r.plain_error, "bar_dtype": bar_dtype, "bar_error": bar_error,
           "ratio": r.error / bar_error, "bf16_error": r.bf16_error, "unwritten": r.unwritten}
    row["meets_bar"] = meets_bar(row)
    return row


def timing_inputs(spec, batch: int, tokens: int, seed: int, device: str = "cuda"):
    """`foldc.bench.decode_case`'s inputs (bf16 queries, standard normals quantized per side); a plain
    side, which decode_case does not make, is the same draw in bf16."""
    from .encoding import quantize

    if spec.k is not None and spec.v is not None:
        return bench.decode_case(spec, batch, tokens, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, device=device, generator=gen).to(torch.bfloat16)
    sides = []
    for enc in (spec.k, spec.v):
        x = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, device=device, generator=gen)
        sides.append(x.to(torch.bfloat16) if enc is None else quantize(x, enc))
    return q, *sides


def best_us(eager: float, graph: float | None) -> float:
    """The better of eager launches and CUDA-graph replay, as `foldc.bench.run_bench` takes it."""
    return min(t for t in (eager, graph) if t is not None)


def time_kernel(attn, spec, batch: int, tokens: int, seed: int) -> dict:
    """µs of ``attn`` on bf16 queries at (batch, tokens), full lengths, and the error of that call's
    first sequence against float64 (the timed call computes the right thing)."""
    from .reference import attention_reference

    q, k, v = timing_inputs(spec, batch, tokens, seed)
    got = attn(q, k, v)
    eager, graph = bench.timed(lambda: attn(q, k, v))
    error = bench._rel(got[:1], attention_reference(q[:1], bench._first(k), bench._first(v)))
    return {"batch": batch, "tokens": tokens, "us": best_us(eager, graph), "us_eager": eager, "us_graph": graph,
            "error": error}


def time_cudnn(make, lay: Layout, batch: int, tokens: int) -> dict:
    """µs of torch SDPA (cuDNN backend, bf16, enable_gqa) on random bf16 q, K, V of ``lay``'s heads."""
    q = torch.randn(batch, lay.q_heads, lay.head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, lay.kv_heads, tokens, lay.head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, lay.kv_heads, tokens, lay.head_dim, device="cuda", dtype=torch.bfloat16) + 0.5
    try:
        fn = make(q, k, v)
        with bench.selected(fn):
            fn()
            eager, graph = bench.timed(fn)
        return {"us": best_us(eager, graph), "us_eager": eager, "us_graph": graph}
    except Exception as e:  # e.g. a head_dim cuDNN does not take here: the x cuDNN cells stay empty
        print(f"  cuDNN SDPA {lay.q_heads}/{lay.kv_heads} d{lay.head_dim} {batch}x{tokens}: {message(e)}",
              flush=True)
        return {"us": None, "failed": message(e)}
    finally:
        del q, k, v
        torch.cuda.empty_cache()


def cudnn_key(lay: Layout, batch: int, tokens: int) -> str:
    return f"{lay.q_heads}/{lay.kv_heads} d{lay.head_dim} {batch}x{tokens}"


@dataclass
class Run:
    """What every layout of one run shares."""

    target: str                       # foldc.compile target: "auto" (a GPU) or "interpret"
    check_shape: tuple[int, int]
    time_shapes: tuple = ()           # empty: checks only
    ceiling: float = math.nan         # bytes/s: the run's ceiling so far (`run_ceiling`)
    stream_read: float = math.nan     # bytes/s of the streaming read
    cudnn_make: object = None         # foldc.bench.peers()["sdpa cudnn bf16"]
    cudnn: dict | None = None         # cudnn_key -> time_cudnn's dict

    @property
    def device(self) -> str:
        return "cpu" if self.target == "interpret" else "cuda"

    @property
    def dtypes(self) -> dict:
        """Query dtypes to check: fp16 only under the interpreter."""
        return {"fp16": torch.float16} if self.target == "interpret" else QUERY_DTYPES


def run_layout(lay: Layout, run: Run) -> dict:
    """Check ``lay`` with each query dtype and time it at each shape; never raises: a FoldError is a
    refusal, anything else a failure, each recorded with its message."""
    import foldc

    row = {**lay.describe(), "checks": {}, "timings": []}
    seed = zlib.crc32(lay.label.encode())
    try:
        spec = lay.spec()
        attn = foldc.compile(spec, target=run.target)
    except FoldError as e:
        return {**row, "status": "refused", "message": message(e)}
    except Exception as e:
        return {**row, "status": "failed", "message": message(e)}
    for name, dtype in run.dtypes.items():
        try:
            row["checks"][name] = check(attn, spec, dtype, run.check_shape, run.device, seed)
        except FoldError as e:
            row["checks"][name] = {"refused": message(e)}
        except Exception as e:
            row["checks"][name] = {"failed": message(e)}
    for batch, tokens in run.time_shapes:
        if "bf16" not in row["checks"] or "kernel" not in row["checks"]["bf16"]:
            break   # bf16 queries were refused or failed: nothing to time
        try:
            timing = time_kernel(attn, spec, batch, tokens, seed)
        except Exception as e:  # e.g. out of memory at this shape: the other shapes still run
            row["timings"].append({"batch": batch, "tokens": tokens, "failed": message(e)})
            continue
        finally:
            torch.cuda.empty_cache()   # this shape's inputs go back before the next allocation
        key = cudnn_key(lay, batch, tokens)
        if key not in run.cudnn:
            run.cudnn[key] = time_cudnn(run.cudnn_make, lay, batch, tokens)
        run.ceiling = bench.run_ceiling(run.ceiling, [(bf16_bytes(lay, batch, tokens), run.cudnn[key]["us"]),
                                                      (must_read(lay, batch, tokens), timing["us"])])
        timing.update(speed(lay, batch, tokens, timing["us"], run.cudnn[key]["us"], run.ceiling),
                      cudnn_us=run.cudnn[key]["us"])
        row["timings"].append(timing)
    row["status"] = status(row)
    return row


def status(row: dict) -> str:
    """refused (foldc refused the spec, or every query dtype), failed (something raised that is not a
    FoldError), over bar (a check missed it), else ok."""
    if row.get("status") in ("refused", "failed"):
        return row["status"]
    checks = row["checks"].values()
    if any("failed" in c for c in checks) or any("failed" in t for t in row["timings"]):
        return "failed"
    ran = [c for c in checks if "refused" not in c]
    if not ran:
        return "refused"
    return "ok" if all(c["meets_bar"] for c in ran) else "over bar"


def run_grid(layouts, out_dir: Path, target: str = "auto", check_shape=(2, 16384), time_shapes=TIME_SHAPES,
             grid_name: str = "timed", jobs: int = 1) -> dict:
    """Check (and, with ``time_shapes``, time) every layout; writes layouts.json after each one and
    layouts.txt at the end. ``jobs`` > 1 (checks only: timings need the GPU to themselves) checks the
    layouts in that many worker processes side by side (each compiles its own kernels, the slow part of a
    check), the rows kept in the grid's order."""
    if jobs > 1 and time_shapes:
        raise ValueError("jobs > 1 checks only: timings need the GPU to themselves (pass no time_shapes)")
    out_dir.mkdir(parents=True, exist_ok=True)
    run = Run(target, tuple(check_shape), tuple(time_shapes), cudnn={})
    gpu = torch.cuda.get_device_name() if run.device == "cuda" else "CPU (Triton interpreter)"
    results = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "triton": _triton_version(),
               "grid": grid_name, "target": target, "options": "default (no tuning cache)",
               "check_shape": list(run.check_shape), "time_shapes": [list(s) for s in run.time_shapes],
               "query_dtypes": list(run.dtypes), "ceiling_tb_s": None, "cudnn": run.cudnn, "rows": []}
    with without_tuning_cache():
        if run.time_shapes:
            torch.manual_seed(0)
            run.ceiling = run.stream_read = bench.stream_read_ceiling()
            results["ceiling_tb_s"] = results["stream_read_tb_s"] = run.ceiling / 1e12
            print(f"{gpu}: streaming-read ceiling {run.ceiling / 1e12:.2f} TB/s", flush=True)
            run.cudnn_make = bench.peers()["sdpa cudnn bf16"]
        print(header(results, len(layouts)), flush=True)
        done = [None] * len(layouts)
        for count, (i, row) in enumerate(_rows(layouts, run, jobs), 1):
            done[i] = row
            results["rows"] = [r for r in done if r is not None]
            print(f"[{count}/{len(layouts)} {row['seconds']:.0f} s] " + " | ".join(table_cells(row)), flush=True)
            (out_dir / "layouts.json").write_text(json.dumps(results, indent=1))
    if run.time_shapes:
        set_ceiling(results, run.ceiling)
        (out_dir / "layouts.json").write_text(json.dumps(results, indent=1))
    (out_dir / "layouts.txt").write_text(format_table(results))
    return results


def set_ceiling(results: dict, ceiling: float) -> None:
    """The run's final ceiling (bytes/s, `foldc.bench.run_ceiling` over every timing) in ``results`` and every
    timing's % of it: a layout timed before the fastest read of the run was printed against a lower one."""
    results["ceiling_tb_s"] = ceiling / 1e12
    for row in results["rows"]:
        for t in row["timings"]:
            if "us" in t and "bytes" in t:
                t["pct_ceiling"] = 100 * t["bytes"] / (t["us"] * 1e-6) / ceiling


def _timed_row(lay: Layout, run: Run) -> dict:
    start = time.time()
    row = run_layout(lay, run)
    row["seconds"] = time.time() - start
    return row


def _rows(layouts, run: Run, jobs: int):
    """(index, row) of every layout as each finishes: one after another, or in ``jobs`` spawned worker
    processes (each with its own CUDA context; FOLDC_CACHE_DIR as this process has it)."""
    if jobs <= 1:
        for i, lay in enumerate(layouts):
            yield i, _timed_row(lay, run)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_timed_row, lay, run): i for i, lay in enumerate(layouts)}
        for future in as_completed(futures):
            yield futures[future], future.result()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------

COLUMNS = ("K", "V", "GQA", "head_dim", "shape", "kernel", "µs", "% ceiling", "x cuDNN", "x ideal",
           "err bf16", "err fp16", "bar")


def _num(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def error_cell(check: dict | None) -> str:
    """``2.1e-03 (0.8x)``: relative L2 vs float64 (and over plain attention in that dtype)."""
    if check is None:
        return "-"
    if "refused" in check or "failed" in check:
        return "refused" if "refused" in check else "failed"
    return f"{check['error']:.1e} ({check['ratio']:.2f}x)"


def kernel_cell(row: dict) -> str:
    """The bf16 queries' kernel, and fp16's where it is another one."""
    names = {dtype: c["kernel"] for dtype, c in row["checks"].items() if "kernel" in c}
    first = names.get("bf16") or names.get("fp16") or "-"
    if "bf16" in names and names.get("fp16", first) != first:
        return f"{first} (fp16: {names['fp16']})"
    return first


def table_cells(row: dict, timing: dict | None = None) -> list[str]:
    """The cells of one (layout, timed shape) line; ``timing`` None: the layout's first timing, if any."""
    if timing is None and row["timings"]:
        timing = row["timings"][0]
    timing = timing or {}
    shape = f"{timing['batch']}x{timing['tokens']}" if timing else "-"
    bar = {"ok": "yes", "over bar": "NO"}.get(row["status"], row["status"])
    return [row["k"], row["v"], f"{row['q_heads']}/{row['kv_heads']} ({row['q_heads'] // row['kv_heads']})",
            str(row["head_dim"]), shape, kernel_cell(row) if row["checks"] else "-",
            _num(timing.get("us"), ".1f"), _num(timing.get("pct_ceiling"), ".0f"), _num(timing.get("x_cudnn"), ".2f"),
            _num(timing.get("x_ideal"), ".2f"), error_cell(row["checks"].get("bf16")),
            error_cell(row["checks"].get("fp16")), bar]


def header(results: dict, count: int) -> str:
    """Three lines: where and how the run went, what the timing columns mean, what the errors are."""
    batch, tokens = results["check_shape"]
    run = (f"{results['gpu']}, {results['date']}, torch {results['torch']}, triton {results['triton']}; "
           f"grid {results['grid']} ({count} layouts), target {results['target']}, {results['options']}")
    if results["time_shapes"]:
        shapes = ", ".join(f"{b}x{n}" for b, n in results["time_shapes"])
        stream = results.get("stream_read_tb_s", results["ceiling_tb_s"])
        timing = (f"ceiling {results['ceiling_tb_s']:.2f} TB/s (the faster of a streaming read, {stream:.2f} TB/s, "
                  f"and the fastest must-read rate timed, cuDNN's included, same run); timed at {shapes} "
                  "(bf16 queries, full lengths; % ceiling on codes + scales + zeros + q + out); "
                  "x cuDNN = cuDNN SDPA bf16 µs / ours; x ideal = x cuDNN / (bf16 bytes / ours)")
    else:
        timing = "not timed (checks only)"
    errors = (f"err: relative L2 vs float64 over the dequantized cache at {batch} x {tokens} tokens, ragged "
              f"lengths, (Nx) = over plain attention in the plan's bar dtype (bf16 for the register-operand kernel, the "
              f"query's for the Triton kernel); bar: <= {TARGET:g}x in every dtype checked")
    return "\n".join((run, timing, errors))


def format_table(results: dict) -> str:
    """The markdown table, one line per (layout, timed shape), then the refused and failed layouts."""
    lines = [header(results, len(results["rows"])), "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in results["rows"]:
        if row["status"] == "refused" and not row["checks"]:
            continue
        for timing in row["timings"] or [None]:
            lines.append("| " + " | ".join(table_cells(row, timing)) + " |")
    counts = {s: sum(r["status"] == s for r in results["rows"]) for s in ("ok", "over bar", "refused", "failed")}
    lines += ["", f"{len(results['rows'])} layouts: {counts['ok']} meet the bar, {counts['over bar']} over it, "
                  f"{counts['refused']} refused, {counts['failed']} failed"]
    lines += target_lines(results)
    for kind in ("refused", "failed"):
        notes = [f"- {r['label']}: {note}" for r in results["rows"] for note in notes_of(r, kind)]
        if notes:
            lines += ["", f"{kind}:"] + notes
    return "\n".join(lines) + "\n"


#: the grid's speed bars (issue 18): a share of the read ceiling at shapes of at least CEILING_TOKENS (batch x
#: tokens), and no layout slower than cuDNN bf16 at CUDNN_TOKENS tokens or more
CEILING_BAR, CEILING_TOKENS, CUDNN_TOKENS = 60.0, 512 * 1024, 16 * 1024


def target_lines(results: dict) -> list[str]:
    """Per timed shape: how many layouts read at CEILING_BAR% of the ceiling or more (at CEILING_TOKENS batch x
    tokens and up) and which do not, and which are slower than cuDNN (at CUDNN_TOKENS tokens and up)."""
    lines = []
    for batch, tokens in results["time_shapes"]:
        timed = [(row["label"], t) for row in results["rows"] for t in row["timings"]
                 if t["batch"] == batch and t["tokens"] == tokens and "us" in t]
        if not timed:
            continue
        shape = f"{batch}x{tokens}"
        if batch * tokens >= CEILING_TOKENS:
            below = [f"{label} ({t['pct_ceiling']:.0f}%)" for label, t in timed if t["pct_ceiling"] < CEILING_BAR]
            lines.append(f"{shape}: {len(timed) - len(below)} of {len(timed)} timed layouts at >= {CEILING_BAR:g}% "
                         f"of the ceiling" + (f"; below: {', '.join(below)}" if below else ""))
        if tokens >= CUDNN_TOKENS:
            slower = [f"{label} ({t['x_cudnn']:.2f}x)" for label, t in timed if t["x_cudnn"] < 1]
            lines.append(f"{shape}: slower than cuDNN: {', '.join(slower) if slower else 'none'}")
    return [""] + lines if lines else []


def notes_of(row: dict, kind: str) -> list[str]:
    """The ``kind`` ("refused" or "failed") messages of a row: the layout's own, each query dtype's
    and each timing's."""
    notes = [row["message"]] if row.get("status") == kind and "message" in row else []
    notes += [f"{dtype} queries: {c[kind]}" for dtype, c in row["checks"].items() if kind in c]
    if kind == "failed":
        notes += [f"{t['batch']}x{t['tokens']}: {t['failed']}" for t in row["timings"] if "failed" in t]
    return notes


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

def parse_shapes(text: str, flag: str, ap: argparse.ArgumentParser) -> tuple:
    """``8x65536,2x16384`` -> ((8, 65536), (2, 16384)); a usage error otherwise."""
    try:
        shapes = tuple(tuple(int(x) for x in item.lower().split("x")) for item in text.split(","))
    except ValueError:
        ap.error(f"{flag}={text!r}: use BATCHxTOKENS items separated by commas, e.g. 8x65536")
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        ap.error(f"{flag}={text!r}: each item is BATCHxTOKENS with both at least 1")
    return shapes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="foldc bench --layouts", description=__doc__.split("\n")[0])
    ap.add_argument("--grid", choices=("quick", "timed", "full"), default="timed",
                    help="quick: 6 layouts; timed: the representative subset (default); full: every layout, "
                         "checked (timed too with --time-all)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated BATCHxTOKENS to time at (default 8x65536)")
    ap.add_argument("--check-shape", default=None,
                    help="BATCHxTOKENS to check at (default 2x16384 for --grid timed, 2x4096 otherwise, 2x80 "
                         "under --target interpret)")
    ap.add_argument("--out", default="results", help="output folder (default results/)")
    ap.add_argument("--check-only", action="store_true", help="check correctness only: no ceiling, cuDNN or timing")
    ap.add_argument("--time-all", action="store_true", help="with --grid full: time every layout as well")
    ap.add_argument("--target", choices=("auto", "sm_90", "sm_100", "interpret"), default="auto",
                    help="foldc.compile target; interpret (CPU, fp16 queries) needs --check-only")
    ap.add_argument("--only", default=None,
                    help="comma-separated labels or substrings of labels, e.g. 'K token:2:128 V token:2:128 32/8'")
    ap.add_argument("--list", action="store_true", help="print the grid's layout labels and exit")
    ap.add_argument("--jobs", type=int, default=1,
                    help="check layouts in this many processes side by side (checks only; default 1)")
    args = ap.parse_args(argv)
    from .options import cli_items, cli_out_dir

    wanted = cli_items(ap, "--only", args.only)
    layouts = pick(grid(args.grid), wanted)
    if not layouts:
        ap.error(f"--only={args.only!r} matches no layout of --grid {args.grid}; see --list")
    if args.list:
        print("\n".join(lay.label for lay in layouts))
        return 0
    time_shapes = parse_shapes(args.shapes, "--shapes", ap) if cli_items(ap, "--shapes", args.shapes) else TIME_SHAPES
    if args.target == "interpret":
        if not args.check_only:
            ap.error("--target interpret only checks correctness (the interpreter cannot time kernels); "
                     "add --check-only")
        check_shape = INTERPRET_CHECK_SHAPE
    else:
        check_shape = CHECK_SHAPES[args.grid]
    if cli_items(ap, "--check-shape", args.check_shape):
        shapes = parse_shapes(args.check_shape, "--check-shape", ap)
        if len(shapes) > 1:   # the first was checked, the others dropped silently
            ap.error(f"--check-shape={args.check_shape!r}: give one BATCHxTOKENS shape to check at (--shapes takes "
                     "several, to time at)")
        check_shape = shapes[0]
    if args.check_only or (args.grid == "full" and not args.time_all):
        time_shapes = ()
    if args.jobs < 1:
        ap.error(f"--jobs={args.jobs}: give at least 1 process")
    if args.jobs > 1 and time_shapes:
        ap.error(f"--jobs={args.jobs} checks only (timings need the GPU to themselves): add --check-only")
    if args.target != "interpret" and not torch.cuda.is_available():
        print("foldc bench --layouts needs a CUDA GPU (it times kernels); none is visible. On the CPU, "
              "`foldc bench --layouts --check-only --target interpret` checks the layouts under Triton's "
              "interpreter", file=sys.stderr)
        return 2
    cli_out_dir(ap, args.out)
    results = run_grid(layouts, Path(args.out), args.target, check_shape, time_shapes, args.grid, args.jobs)
    print(format_table(results))
    return 0 if all(r["status"] in ("ok", "refused") for r in results["rows"]) else 1
