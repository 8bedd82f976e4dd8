"""`foldc bench`: decode-attention timing on one GPU, in one run, against the HBM ceiling and peers.

Rows: the HBM read ceiling (the faster of a streaming-read Triton kernel and the fastest row, both measured in
the same run: `run_ceiling`), foldc's fold kernels for the four K/V layouts at INT2 and INT4 (group 128; INT2
token-wise also at 64 and 32), foldc's per-value dequant kernel (fold_policy="dequant") and foldc's bf16 kernel, and
the peers torch SDPA (cuDNN and flash backends, bf16, enable_gqa) and FlashInfer's bf16 decode
when it imports. Shapes: 32 query heads, 8 KV heads, head_dim 128; batch x context from the
issue's grid. Per row: median time (triton do_bench; the better of eager launches and CUDA-graph
replay, for every kernel and peer alike; both are kept in the JSON, with the host time of one eager
call on an idle GPU, `foldc.timing.host_us`: the launch path alone), bandwidth on the bytes the kernel must
read (codes + scales + zeros + query + output) as % of the ceiling, speed-up over each peer,
and the relative L2 error against float64 attention over the same (dequantized) cache.

Writes ``bench.json``, ``bench.png`` and ``bench.txt`` under the output folder.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from .timing import capture_graph, host_us

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
GRID = ((1, 4096), (1, 16384), (1, 65536), (1, 131072), (8, 4096), (8, 16384), (8, 65536), (8, 131072),
        (32, 4096), (32, 16384), (32, 65536), (64, 32768))
QUICK_GRID = ((1, 16384), (8, 65536), (32, 16384))


def kernel_list(quick: bool):
    """(label, k encoding, v encoding, policy) for every foldc row. policy "auto": whichever kernel
    compile() picks (the register-operand kernel where it lowers the plan on sm_90); "triton": the
    generated Triton kernel for the same plan; "dequant": per-value reconstruction (Triton)."""
    from .encoding import Affine

    rows = []
    for bits in (2, 4):
        for kl in ("token", "channel"):
            for vl in ("token", "channel"):
                rows.append((f"fold INT{bits} K{kl[0]}V{vl[0]} g128", Affine(bits, kl, 128), Affine(bits, vl, 128), "auto"))
    if not quick:
        for g in (64, 32):
            rows.append((f"fold INT2 KtVt g{g}", Affine(2, "token", g), Affine(2, "token", g), "auto"))
    rows.append(("fold INT2 KtVt g128 (triton)", Affine(2, "token", 128), Affine(2, "token", 128), "triton"))
    rows.append(("dequant INT2 KtVt g128", Affine(2, "token", 128), Affine(2, "token", 128), "dequant"))
    rows.append(("dequant INT4 KtVt g128", Affine(4, "token", 128), Affine(4, "token", 128), "dequant"))
    rows.append(("foldc bf16", None, None, "auto"))
    if quick:
        rows = [r for r in rows if "Kc" not in r[0] or "INT2" in r[0]]
    return rows


def stream_read_ceiling(gib: float = 4.0) -> float:
    """Bytes/s of a Triton streaming read (sum) over ``gib`` GiB: 8 waves of programs per SM."""
    import triton
    import triton.language as tl
    from triton.testing import do_bench

    @triton.jit
    def _read(X, OUT, n_per_prog, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * n_per_prog
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(0, n_per_prog, BLOCK):
            acc += tl.load(X + base + i + tl.arange(0, BLOCK)).to(tl.float32)
        tl.store(OUT + pid, tl.sum(acc))

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    progs = 8 * sms
    block = 4096
    n = int(gib * 2**30 / 2) // (progs * block) * (progs * block)
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(progs, device="cuda", dtype=torch.float32)
    ms = do_bench(lambda: _read[(progs,)](x, out, n // progs, BLOCK=block, num_warps=8), warmup=50, rep=300,
                  return_mode="median")
    return x.numel() * 2 / (ms * 1e-3)


def cache_bytes(enc, batch: int, tokens: int) -> int:
    """Bytes of one cache side at bench.py's heads and head_dim: codes plus a scale and a zero per group as
    `foldc.quantize` stores them (`scale_shape`: a partial last channel-wise group counts whole), or bf16 values."""
    from .encoding import scale_shape

    values = batch * KV_HEADS * tokens * HEAD_DIM
    if enc is None:
        return values * 2
    params = math.prod(scale_shape(enc, batch, KV_HEADS, tokens, HEAD_DIM))
    return values * enc.bits // 8 + 2 * params * torch.tensor([], dtype=enc.scale_dtype).element_size()


def run_ceiling(stream_read: float, reads) -> float:
    """The read ceiling of a run in bytes/s: the larger of the streaming read (`stream_read_ceiling`) and the fastest
    rate any timed row of the same run reached on the bytes it must read (``reads``: (bytes, µs) pairs; an entry
    with no time is skipped). Every timing flushes the L2, so a row's must-read rate is a rate the card reached: a
    "ceiling" below it is no ceiling (cuDNN bf16 read 4.67 TB/s at 32 x 64K against a streaming read of 4.31 on the
    H200 of 2026-12-04), and % of it would overstate every row by that much."""
    best = max((nbytes / (us * 1e-6) for nbytes, us in reads if us), default=0.0)
    return best if math.isnan(stream_read) else max(stream_read, best)


def set_ceiling(results: dict, stream_read: float) -> None:
    """Put the run's ceiling (`run_ceiling` over every row so far) in ``results`` and each row's % of it."""
    ceiling = run_ceiling(stream_read, ((r["bytes"], r["us"]) for r in results["rows"]))
    results["stream_read_tb_s"], results["ceiling_tb_s"] = stream_read / 1e12, ceiling / 1e12
    for r in results["rows"]:
        r["pct_ceiling"] = 100 * r["bytes"] / (r["us"] * 1e-6) / ceiling


def must_read(k_enc, v_enc, batch: int, tokens: int) -> int:
    """Bytes a decode kernel must move: the cache, the query and the output (bf16)."""
    return cache_bytes(k_enc, batch, tokens) + cache_bytes(v_enc, batch, tokens) + 2 * 2 * batch * HEADS * HEAD_DIM


def decode_case(spec, batch: int, tokens: int, seed: int, device: str = "cuda"):
    """Fresh random decode inputs for ``spec``: q [batch, q heads, head_dim] bf16 and k, v quantized
    from standard normals [batch, kv heads, tokens, head_dim] (the sweeps' shared inputs)."""
    import foldc

    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, device=device, generator=gen).to(torch.bfloat16)
    k, v = (foldc.quantize(torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, device=device, generator=gen),
                           enc) for enc in (spec.k, spec.v))
    return q, k, v



def gluon_call_parts(attn, q, k, v, sm_scale: float) -> dict:
    """The pieces of one register-operand call (a `GluonAttention` over every cached token), for
    benchmarks that launch its kernels by hand: launch config, splits, tokens per split, workspace,
    the decode kernel's (args, kwargs) and grid."""
    b, n = q.shape[0], k.shape[2]
    launch = attn.launch_config(q.dtype, b, n, q.device)
    splits, per_split = attn.split_plan(launch, b, n, q.device, q.dtype)
    ws = attn.workspace(launch, b, splits, q.device)
    args, kwargs = attn.decode_arguments(launch, q, k, v, None, ws, sm_scale, per_split, n, None)
    return dict(launch=launch, splits=splits, per_split=per_split, ws=ws, args=args, kwargs=kwargs,
                grid=(b, attn.head_programs(launch), splits))


def rebound(jit_function, **names):
    """A copy of a Gluon/Triton function whose global ``names`` are replaced (the callees it compiles): how a
    benchmark's variant swaps one function of a production kernel and keeps the rest of its source as it is
    (benchmarks/gemv_variants.py, benchmarks/warpgroup_variants.py)."""
    from triton.experimental import gluon

    from .backends.runtime.modules import with_globals

    f = jit_function   # keep the decorator's options: a launch binds ``cache_tokens`` per call only if unspecialised
    return gluon.jit(with_globals(f.fn, **names), do_not_specialize=f.do_not_specialize,
                     do_not_specialize_on_alignment=f.do_not_specialize_on_alignment, noinline=f.noinline)


def decode_variant_builds(variant, name: str, cases, **options) -> list[dict]:
    """Registers, SASS per tile, spilled instructions and shared loads (LDS) of the production decode kernel and of
    ``variant`` (a kernel with its signature: `rebound`, or a module's copy of foldc/backends/gluon/kernel.py) for
    each (K, V, heads, head_dim) of ``cases``, built ahead of time for sm_90 with the launcher's defaults or
    ``options`` (`compile_gluon_aot`'s: block_n, maxnreg, ...; CPU, no GPU; TRITON_INTERPRET unset)."""
    import tempfile
    from collections import Counter
    from pathlib import Path

    import foldc.backends.gluon.kernel as production

    from .backends.gluon.aot import compile_gluon_aot
    from .backends.runtime.sass import loop_instructions
    from .spec import spec_from_args

    kept, rows = production.foldc_decode_gluon, []
    for case in cases:
        for label, kernel in (("production", kept), (name, variant)):
            production.foldc_decode_gluon = kernel   # compile_gluon_aot builds the module's kernel
            try:
                with tempfile.TemporaryDirectory() as out:
                    r = compile_gluon_aot(spec_from_args(*case[:3], case[3]), "sm_90", out, **options)
                    ops = Counter(o for _, o, _ in loop_instructions(next(Path(out).glob("*.sm_90.cubin"))))
            finally:
                production.foldc_decode_gluon = kept
            loop = r["inner_loop"]
            rows.append(dict(k=case[0], v=case[1], heads=case[2], head_dim=case[3], kernel=label,
                             registers=r["registers"], tile_sass=loop["instructions_per_tile"],
                             spills=loop["local_memory"], lds=ops.get("LDS", 0)))
            print(f"{' / '.join(map(str, case))} {label:12}: {r['registers']} registers, "
                  f"{loop['instructions_per_tile']:.0f} "
                  f"SASS per tile, spills {loop['local_memory']}, LDS {ops.get('LDS', 0)}", flush=True)
    return rows


def gemv_variant_builds(variant, name: str, cases, loop_copies: int = 1, dtypes=("fp16",)) -> list[dict]:
    """Registers and SASS per chunk of the production GEMV and of ``variant`` (a kernel made with `rebound` from
    foldc/backends/gluon/gemv.py) for each (weight encoding, n, k, m) of ``cases`` and activation dtype of
    ``dtypes``, built ahead of time for sm_90 (CPU, no GPU; TRITON_INTERPRET unset). ``loop_copies``: chunks in one
    pass of the variant's loop body (an unrolled loop)."""
    import tempfile

    import foldc.backends.gluon.gemv as production

    from .backends.gluon.gemv_aot import compile_gemv_aot
    from .gemm import GemmSpec, parse_gemm_encoding

    kept, rows = production.foldc_gemv_gluon, []
    for (enc, n, k, m), dtype in ((case, dtype) for case in cases for dtype in dtypes):
        for label, kernel, copies in (("production", kept, 1), (name, variant, loop_copies)):
            production.foldc_gemv_gluon = kernel   # compile_gemv_aot builds the module's kernel
            try:
                with tempfile.TemporaryDirectory() as out:
                    r = compile_gemv_aot(GemmSpec(n, k, parse_gemm_encoding(enc, "weight")), "sm_90", out, m=m,
                                         dtype=dtype)
            finally:
                production.foldc_gemv_gluon = kept
            loop = r["chunk_loop"]
            rows.append(dict(weight=enc, n=n, k=k, m=m, dtype=dtype, kernel=label, registers=r["registers"],
                             chunk_sass=loop["instructions_per_warp"] / copies, spills=loop["local_memory"]))
            print(f"{enc} {n}x{k} m={m} {dtype} {label:10}: {r['registers']} registers, {rows[-1]['chunk_sass']:.0f} "
                  f"SASS per chunk, {rows[-1]['spills']} local-memory instructions", flush=True)
    return rows


def save_rows(rows: list, path: str) -> None:
    """Write the rows so far (a sweep cut off by its time limit keeps what it measured) and give the
    last case's memory back."""
    torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def timed(fn) -> tuple[float, float | None]:
    """(eager median us, CUDA-graph replay median us or None if capture failed)."""
    from triton.testing import do_bench

    eager = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    try:
        graph = capture_graph(fn)
        replay = do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
    except Exception as e:  # some peers cannot be captured; the eager time stands
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:100]})", flush=True)
        replay = None
    return eager, replay


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def sdpa_peer(backend):
    """factory(q [batch, q heads, d], k, v [batch, KV heads, tokens, d]) -> a zero-argument call of torch SDPA with
    ``enable_gqa`` (each KV head read once) and that backend alone (another raises rather than runs in its place).
    The backend is selected once around a measurement (``with run.selected():``), not inside each call: torch's
    ``sdpa_kernel`` context costs about 10 µs of host time, which the peer's host µs counted; a call made outside
    ``run.selected()`` raises (it would let SDPA pick its backend)."""
    import contextlib

    from torch.nn.attention import sdpa_kernel

    inside = [False]   # inside run.selected(): one list lookup a call, not the context's ~10 µs

    @contextlib.contextmanager
    def select():
        with sdpa_kernel(backend):
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False

    def make(q, k, v):
        q4 = q.unsqueeze(2)

        def run():
            if not inside[0]:
                raise RuntimeError(f"SDPA peer {backend.name}: call it inside `with run.selected():`, which selects "
                                   "that backend alone")
            return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True).squeeze(2)
        run.selected = select
        return run
    return make


def selected(fn):
    """The context a peer's call runs in (`sdpa_peer`'s backend selection), or none."""
    import contextlib

    return getattr(fn, "selected", contextlib.nullcontext)()


def peers():
    """name -> factory(q, k_bf16, v_bf16) returning a zero-argument callable; only importable ones."""
    from torch.nn.attention import SDPBackend

    out = {"sdpa cudnn bf16": sdpa_peer(SDPBackend.CUDNN_ATTENTION),
           "sdpa flash bf16": sdpa_peer(SDPBackend.FLASH_ATTENTION)}
    try:
        import flashinfer

        def fi(q, k, v):
            b, hkv, n, d = k.shape
            page = 16
            pages = n // page
            kp = k.permute(0, 2, 1, 3).reshape(b * pages, page, hkv, d).contiguous()
            vp = v.permute(0, 2, 1, 3).reshape(b * pages, page, hkv, d).contiguous()
            ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
            # the tensor-core decode: FlashInfer's own choice for grouped-query heads, ~1.5x faster
            # than its default CUDA-core decode on these shapes (level with cuDNN)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            indptr = torch.arange(b + 1, device="cuda", dtype=torch.int32) * pages
            indices = torch.arange(b * pages, device="cuda", dtype=torch.int32)
            last = torch.full((b,), page, device="cuda", dtype=torch.int32)
            w.plan(indptr, indices, last, HEADS, hkv, d, page, q_data_type=torch.bfloat16,
                   kv_data_type=torch.bfloat16)
            return lambda: w.run(q, (kp, vp))
        out["flashinfer bf16"] = fi
    except Exception as e:  # not installed here: the row is left out, and the table says so
        print(f"(FlashInfer not available: {type(e).__name__}: {e})", file=sys.stderr)
    return out


def selects(wanted: str, label: str, quick: bool = False) -> bool:
    """A --kernels item picks the row of exactly that label if there is one, else every row whose
    label contains it."""
    labels = [r[0] for r in kernel_list(quick)]
    return label == wanted if wanted in labels else wanted in label


def run_bench(out_dir: Path, quick: bool = False, tune: bool = True, shapes=None, kernels=None) -> dict:
    """Time every row on every shape; ``kernels``: only the foldc rows whose label contains one of
    these strings (the ceiling and the peers always run)."""
    from .backends.gluon.lower import lowerable
    from .backends.gluon.tuning import GLUON_CANDIDATES, GluonConfig
    from .backends.triton.tuning import CANDIDATES, Config
    from .backends.triton.launch import launch_options
    from .tune import tune as autotune
    from .compile import compile as compile_attention
    from .encoding import quantize
    from .reference import attention_reference
    from .spec import AttentionSpec

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    stream_read = stream_read_ceiling()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: streaming-read ceiling {stream_read / 1e12:.2f} TB/s", flush=True)
    grid = shapes or (QUICK_GRID if quick else GRID)
    kernels = [r for r in kernel_list(quick) if not kernels or any(selects(w, r[0], quick) for w in kernels)]
    peer_makers = peers()
    results = {"gpu": gpu, "torch": torch.__version__, "ceiling_tb_s": stream_read / 1e12,
               "stream_read_tb_s": stream_read / 1e12, "rows": [],
               "date": time.strftime("%Y-%m-%d"), "quick": quick}
    # a short list keeps the whole grid inside one GPU session (each config compiles once per kernel)
    candidates = tuple(c for c in CANDIDATES if c.num_stages == 2 and c.split_factor == 1.0 and c.block_n >= 64)
    gluon_ok = torch.cuda.get_device_capability()[0] == 9
    for batch, tokens in grid:
        t_shape = time.time()
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16) + 0.5
        k[..., 7] *= 5.0
        shape_rows = {}
        for name, make in peer_makers.items():
            try:
                fn = make(q, k, v)
                with selected(fn):   # once around the measurements: not in the host time of each call
                    got = fn()
                    eager, graph = timed(fn)
                    host = host_us(fn, calls=50)
                ref = attention_reference(q[:1], k[:1], v[:1])
                err = _rel(got[:1].float(), ref)
                shape_rows[name] = (eager, graph, host, must_read(None, None, batch, tokens), err, "")
            except Exception as e:
                print(f"  {name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
        quantized = {}
        for label, k_enc, v_enc, policy in kernels:
            kq = k if k_enc is None else quantized.setdefault(("k", k_enc), quantize(k, k_enc))
            vq = v if v_enc is None else quantized.setdefault(("v", v_enc), quantize(v, v_enc))
            spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, k=k_enc, v=v_enc)
            gluon = policy == "auto" and gluon_ok and lowerable(spec)[0]
            fold_policy = "dequant" if policy == "dequant" else "auto"
            if tune:
                cfg, _ = autotune(spec, q, kq, vq, fold_policy=fold_policy,
                                  candidates=GLUON_CANDIDATES if gluon else candidates,
                                  label=f"{label} b{batch} n{tokens}")
            else:
                cfg = GluonConfig() if gluon else Config()
            if isinstance(cfg, GluonConfig):
                attn = compile_attention(spec, target="sm_90", **cfg.options())
            else:
                attn = compile_attention(spec, target="auto", kernel="triton", fold_policy=fold_policy,
                                         **launch_options(cfg, spec, q, kq))
            got = attn(q, kq, vq)
            eager, graph = timed(lambda: attn(q, kq, vq))
            host = host_us(lambda: attn(q, kq, vq), calls=50)
            ref = attention_reference(q[:1], _first(kq), _first(vq))
            shape_rows[label] = (eager, graph, host, must_read(k_enc, v_enc, batch, tokens), _rel(got[:1], ref),
                                 str(cfg))
        best = {name: min(t for t in (e, g) if t is not None) for name, (e, g, *_) in shape_rows.items()}
        for name, (eager, graph, host, nbytes, err, cfg) in shape_rows.items():
            us = best[name]
            row = {"batch": batch, "tokens": tokens, "kernel": name, "us": us, "us_eager": eager, "us_graph": graph,
                   "us_host": host,
                   "bytes": nbytes, "pct_ceiling": math.nan, "error": err, "config": cfg}   # set_ceiling sets it
            for peer in peer_makers:
                if peer in best:
                    row[f"x_{peer}"] = best[peer] / us
            results["rows"].append(row)
        set_ceiling(results, stream_read)   # every row's % of the ceiling so far (a faster row raises it)
        del k, v, quantized
        torch.cuda.empty_cache()
        print(format_shape(results, batch, tokens) + f"\n  ({time.time() - t_shape:.0f} s)", flush=True)
        (out_dir / "bench.json").write_text(json.dumps(results, indent=1))
    (out_dir / "bench.txt").write_text(format_table(results))
    plot(results, out_dir / "bench.png")
    return results


def _first(x):
    from .encoding import AffineTensor

    if isinstance(x, AffineTensor):
        return AffineTensor(x.codes[:1], x.scale[:1], x.zero[:1], x.encoding, x.head_dim)
    return x[:1]


def format_shape(results: dict, batch: int, tokens: int) -> str:
    rows = [r for r in results["rows"] if r["batch"] == batch and r["tokens"] == tokens]
    lines = [f"batch {batch} x {tokens} tokens:"]
    for r in rows:
        ups = " ".join(f"{k[2:].split()[1] if k.startswith('x_sdpa') else k[2:].split()[0]}={v:.2f}x"
                       for k, v in r.items() if k.startswith("x_"))
        lines.append(f"  {r['kernel']:<24} {r['us']:>9.1f} us {r['pct_ceiling']:>5.0f}% {ups}  err {r['error']:.1e}")
    return "\n".join(lines)


def format_table(results: dict) -> str:
    stream = results.get("stream_read_tb_s", results["ceiling_tb_s"])
    head = (f"{results['gpu']}, {results['date']}, torch {results['torch']}; ceiling "
            f"{results['ceiling_tb_s']:.2f} TB/s (the faster of a streaming read, {stream:.2f} TB/s, and the fastest "
            "row's must-read rate, same run)\n")
    cols = ["batch", "tokens", "kernel", "us", "eager us", "host us", "% ceiling", "x cuDNN", "x flash", "x FlashInfer",
            "error"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results["rows"]:
        cells = [str(r["batch"]), str(r["tokens"]), r["kernel"], f"{r['us']:.1f}", f"{r.get('us_eager', r['us']):.1f}",
                 f"{r.get('us_host', float('nan')):.1f}",
                 f"{r['pct_ceiling']:.0f}",
                 f"{r.get('x_sdpa cudnn bf16', float('nan')):.2f}", f"{r.get('x_sdpa flash bf16', float('nan')):.2f}",
                 f"{r.get('x_flashinfer bf16', float('nan')):.2f}", f"{r['error']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


PEER_PREFIXES = ("sdpa", "flashinfer")   # rows that are not foldc's: drawn dashed
BASELINE = "sdpa cudnn bf16"             # the bar: the lower panel's speed-ups are over it


def plot(results: dict, path: Path):
    """Two panels over the shapes: % of the HBM read ceiling per kernel (one colour each, peers
    dashed, foldc solid) and each foldc kernel's speed-up over cuDNN bf16 (1.0 marked). Returns the
    figure (saved to ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["batch"], r["tokens"]) for r in results["rows"]})
    kernels = sorted({r["kernel"] for r in results["rows"]}, key=lambda k: (k.startswith(PEER_PREFIXES), k))
    cmap = plt.get_cmap("tab20" if len(kernels) > 10 else "tab10")
    colours = {name: cmap(i % cmap.N) for i, name in enumerate(kernels)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    xs = list(range(len(shapes)))

    def series(name, key):
        by_shape = {(r["batch"], r["tokens"]): r.get(key, math.nan) for r in results["rows"] if r["kernel"] == name}
        return [by_shape.get(s, math.nan) for s in shapes]

    for name in kernels:
        peer = name.startswith(PEER_PREFIXES)
        top.plot(xs, series(name, "pct_ceiling"), "--" if peer else "-", marker="s" if peer else "o",
                 color=colours[name], label=name)
        if not peer:
            bottom.plot(xs, series(name, f"x_{BASELINE}"), "-", marker="o", color=colours[name], label=name)
    top.axhline(80, color="grey", linewidth=0.8)
    top.set_ylabel("% of HBM read ceiling\n(bytes the kernel must read)")
    top.set_title(f"decode attention, {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM} — {results['gpu']} "
                  f"({results['date']})")
    top.legend(fontsize=7, ncol=3)
    bottom.axhline(1.0, color="black", linewidth=1.0)
    bottom.set_ylabel(f"speed-up over {BASELINE}")
    bottom.set_xticks(xs, [f"{b}x{t // 1024}K" for b, t in shapes], rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="foldc bench", description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", action="store_true",
                    help="the K/V layout grid instead, checked and timed (see foldc bench --layouts --help; "
                         "foldc/cli.py routes it to foldc/bench_layouts.py; likewise --gemm and --serving)")
    ap.add_argument("--out", default="results", help="output folder (default results/)")
    ap.add_argument("--quick", action="store_true", help="three shapes, fewer kernels and configs")
    ap.add_argument("--no-tune", action="store_true", help="default launch config instead of autotuning")
    ap.add_argument("--shapes", default=None, help="comma-separated BATCHxTOKENS subset of the grid, e.g. 1x16384,8x65536")
    ap.add_argument("--kernels", default=None,
                    help="comma-separated labels or substrings: only those foldc rows, e.g. "
                         "'fold INT2 KtVt g128,fold INT4 KtVt g128' (the ceiling and the peers always run)")
    args = ap.parse_args(argv)
    if args.layouts:
        ap.error("--layouts goes first on the command line: `foldc bench --layouts ...` (foldc/bench_layouts.py)")
    from .options import cli_items, cli_out_dir

    wanted = cli_items(ap, "--kernels", args.kernels)
    if wanted and not any(selects(w, r[0], args.quick) for w in wanted for r in kernel_list(args.quick)):
        ap.error(f"--kernels={args.kernels!r} matches no row; rows are: "
                 + "; ".join(r[0] for r in kernel_list(args.quick)))
    shapes = None
    if cli_items(ap, "--shapes", args.shapes):
        try:
            shapes = tuple(tuple(int(x) for x in item.lower().split("x")) for item in args.shapes.split(","))
        except ValueError:
            ap.error(f"--shapes={args.shapes!r}: use BATCHxTOKENS items separated by commas, e.g. 1x16384,8x65536")
        if any(len(s) != 2 or min(s) < 1 for s in shapes):
            ap.error(f"--shapes={args.shapes!r}: each item is BATCHxTOKENS with both at least 1")
    if not torch.cuda.is_available():
        print("foldc bench needs a CUDA GPU (it times kernels); none is visible", file=sys.stderr)
        return 2
    cli_out_dir(ap, args.out)
    results = run_bench(Path(args.out), quick=args.quick, tune=not args.no_tune, shapes=shapes, kernels=wanted)
    print(format_table(results))
    return 0
