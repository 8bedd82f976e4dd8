"""Autotuning of the generated kernel's launch configuration, cached per shape bucket.

A configuration is (block_n, num_warps, num_stages, split factor). `tune` times each candidate
with triton's do_bench on the caller's tensors and stores the best under a key made of the GPU
name, the torch and triton versions, a fingerprint of the kernel's sources (a changed kernel
tunes again), the spec, the query dtype and a shape bucket (batch
rounded up to a power of two, tokens to a power of two). The cache is a JSON file under
$FOLDC_CACHE_DIR (default ~/.cache/foldc) and survives restarts; `TritonAttention` and
`GluonAttention` look it up when no configuration was given explicitly. It times candidates
through `foldc.compile`, so it lives above the backends (no backend imports `foldc.compile`).
"""
from __future__ import annotations

import statistics
import sys

import torch


from .backends.gluon.tuning import GluonConfig
from .backends.runtime.tuning import bucket_key, store
from .backends.triton.tuning import CANDIDATES, Config
from .backends.triton.launch import launch_options
from .errors import InputError, SpecError, TuneError


def _progress(i: int, n: int, label: str) -> None:
    width = 24
    done = int(width * i / n)
    sys.stderr.write(f"\r  tuning {label:<40.40} [{'#' * done}{'.' * (width - done)}] {i}/{n}")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


# candidates within CONFIRM_WITHIN of the fastest first reading (at most CONFIRM_FINALISTS) are timed
# CONFIRM_ROUNDS more times before one is picked
CONFIRM_FINALISTS, CONFIRM_WITHIN, CONFIRM_ROUNDS = 3, 0.05, 2


def tune(spec, q, k, v, seq_lens=None, fold_policy="auto", candidates=CANDIDATES, label: str = "",
         rep_ms: int = 40) -> tuple[Config, float]:
    """Time every candidate on these tensors, store and return (best config, its microseconds).

    A candidate the compiler rejects is skipped; tensors the kernel cannot take (`foldc.InputError`: a dtype,
    shape or device the spec does not allow) are raised at once, as every candidate would fail on them alike."""
    from .compile import compile as compile_attention   # at call time: tests stand in a fake compile

    kinds = {type(cfg) for cfg in candidates} if isinstance(candidates, (list, tuple)) else None
    if not kinds or not kinds <= {Config, GluonConfig} or len(kinds) > 1:
        raise SpecError(f"candidates must be a non-empty list of Config (Triton kernel) or of GluonConfig "
                        f"(register-operand kernel), one kind per call (its tuned entry is the one kernel's); got "
                        f"{sorted(k.__name__ for k in kinds) if kinds else candidates!r}")
    kernel = "gluon" if kinds == {GluonConfig} else "triton"
    key = bucket_key(spec, q.dtype, q.shape[0], k.shape[2] if hasattr(k, "shape") else k.num_tokens, fold_policy,
                     kernel, q.device)   # the card that times the candidates (not the current one)
    timed = []         # [microseconds, config, call] of every candidate that ran
    skipped = []       # (config, why) of every candidate that did not
    launches = set()   # what the register-operand candidates launch: equal launches are timed once
    for i, cfg in enumerate(candidates):
        _progress(i, len(candidates), label or spec.describe())
        try:
            if isinstance(cfg, GluonConfig):
                attn = compile_attention(spec, target="sm_90", **cfg.options())
                launch = _gluon_launch(attn, q, k, seq_lens)
                if launch in launches:   # e.g. 1, 2 and 3 waves at batch 1, where every split count is capped
                    continue
                launches.add(launch)
            else:
                attn = compile_attention(spec, target="auto", kernel="triton", fold_policy=fold_policy,
                                         **launch_options(cfg, spec, q, k))
            call = (lambda attn=attn: attn(q, k, v, seq_lens=seq_lens))
            us = _time_us(call, rep_ms)
        except InputError:   # the tensors, not this config: no candidate can run on them
            sys.stderr.write("\n")
            raise
        except Exception as e:  # a config the compiler rejects (e.g. out of shared memory) is skipped
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            print(f"\n  skipped {cfg}: {why[:120]}", file=sys.stderr)
            skipped.append((cfg, why))
            continue
        timed.append([us, cfg, call])
    _progress(len(candidates), len(candidates), label or spec.describe())
    if not timed:
        cfg, why = skipped[0]
        fix = (f"tune on a CUDA GPU (q is on {q.device})" if q.device.type != "cuda" else
               "pass candidates the kernel can build (foldc.tune's defaults: candidates=CANDIDATES)")
        raise TuneError(f"no launch configuration ran for {spec.describe()}: all {len(skipped)} failed, the first "
                        f"({cfg}) with {why}; {fix}")
    best_us, best, _ = min(timed, key=lambda t: t[0])
    # the closest few are timed again, in alternating rounds, and ranked by the median of their
    # readings: one lucky first reading should not pick the config (readings of one launch differ
    # by a few percent, docs/perf.md)
    finalists = [t for t in sorted(timed, key=lambda t: t[0])[:CONFIRM_FINALISTS]
                 if t[0] <= best_us * (1 + CONFIRM_WITHIN)]
    if len(finalists) > 1:
        readings = [[t[0]] for t in finalists]
        for _ in range(CONFIRM_ROUNDS):
            for t, seen in zip(finalists, readings):
                seen.append(_time_us(t[2], rep_ms))
        medians = [statistics.median(seen) for seen in readings]
        j = min(range(len(finalists)), key=medians.__getitem__)
        best_us, best = medians[j], finalists[j][1]
    store(key, best, best_us)
    return best, best_us


def _time_us(fn, rep_ms: int) -> float:
    """Median microseconds of ``fn``, replayed as a CUDA graph where it captures: what serving
    engines run and what the benchmark reports. Eager calls of small shapes time the host's launch
    path (80-190 µs at batch 1 on the H200, docs/perf.md), which would pick configs at random."""
    from triton.testing import do_bench

    from .timing import capture_graph

    if torch.cuda.is_available():
        try:
            graph = capture_graph(fn, warmup_calls=2)
            return do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median") * 1e3
        except Exception as e:  # not capturable: time eager calls
            print(f"\n  (CUDA graph capture failed, timing eager calls: {type(e).__name__})", file=sys.stderr)
    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def _gluon_launch(attn, q, k, seq_lens) -> tuple:
    """What a register-operand launch runs for these tensors: tile, stages, register cap, packed
    heads, scale schedule and split count."""
    batch, tokens = q.shape[0], k.shape[2] if hasattr(k, "shape") else k.num_tokens
    launch = attn.launch_config(q.dtype, batch, tokens, q.device)
    splits, _ = attn.split_plan(launch, batch, tokens, q.device, q.dtype, seq_lens is not None)
    return (launch["block_n"], launch["stages"], launch["maxnreg"], launch["heads"], launch["scale_ahead"], splits)
