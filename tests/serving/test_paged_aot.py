"""The paged decode kernel builds natively for sm_90 and sm_100 (no GPU needed: triton bundles
ptxas), with the GPU-only inline-PTX code construction, and still feeds the tensor cores: the
interpreter tests cannot show that the native compiler accepts the page-table address arithmetic."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BUILD = r"""
import json, re, sys
import torch
import triton
from foldc.backends.triton.aot import specialize
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import foldc
from foldc.backends.runtime.modules import interpreter
from foldc.backends.runtime.modules import load_module
from foldc.backends.triton.launch import kernel_source, runtime_arguments

A = foldc.Affine
out = []
for arch, dtype, k, v in json.loads(sys.argv[1]):
    spec = foldc.AttentionSpec(32, 8, 128, foldc.encoding.parse_affine(k), foldc.encoding.parse_affine(v))
    ks, geo, _ = kernel_source(spec, dtype, 64, fast=True, paged=True)
    module = load_module(ks.source, interpret=False)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    pages = 40
    kp = foldc.quantize(torch.randn(pages, 8, 128, 128), spec.k)
    vp = foldc.quantize(torch.randn(pages, 8, 128, 128), spec.v)
    ws = (torch.empty(4, 8, 4, geo.rows),) * 2 + (torch.empty(4, 8, 4, geo.rows, 128),)
    values = runtime_arguments(torch.randn(4, 32, 128).to(tdt), kp, vp, torch.ones(4, dtype=torch.int32), ws,
                               0.1, 1024, 4)
    values.update(KV_INDPTR=torch.zeros(5, dtype=torch.int32), KV_INDICES=torch.zeros(pages, dtype=torch.int32))
    sig, const, attrs = specialize(ks.args, values)
    const.update(Q_PER_KV=4, ROWS=geo.rows, BLOCK_N=geo.block_n, HEAD_DIM=128, NUM_KV_HEADS=8, PAGE_SIZE=128)
    sig.update({c: "constexpr" for c in const})
    with interpreter(False):
        c = triton.compile(ASTSource(module.foldc_decode, sig, constexprs=const, attrs=attrs),
                           target=GPUTarget("cuda", {"sm_90": 90, "sm_100": 100}[arch], 32),
                           options={"num_warps": 4, "num_stages": 2})
    ptx = c.asm["ptx"]
    out.append({"case": [arch, dtype, k, v], "cubin": len(c.asm["cubin"]),
                "mma": len(re.findall(r"\bmma\.sync|\bwgmma\.mma_async|\btcgen05\.mma", ptx)),
                "lop3": len(re.findall(r"\blop3\.b32", ptx))})
print(json.dumps(out))
"""


def test_paged_kernels_build_for_sm90_and_sm100(tmp_path):
    jobs = [["sm_90", "bf16", "token:2:128", "channel:2:128"], ["sm_90", "fp16", "channel:4:128", "token:4:128"],
            ["sm_100", "bf16", "token:4:128", "token:2:128"]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["FOLDC_CACHE_DIR"] = str(tmp_path / "foldc")
    proc = subprocess.run([sys.executable, "-c", BUILD, json.dumps(jobs)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(jobs)
    for r in results:
        assert r["cubin"] > 0 and r["mma"] > 0, r
        assert r["lop3"] > 0, f"{r}: the inline-PTX code construction is missing"
