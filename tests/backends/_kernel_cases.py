"""Helpers shared by the Triton backend tests (not a test module)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from foldc.reference import attention_reference
from foldc.testing import bf16_attention, random_inputs, rel_l2

ROOT = Path(__file__).resolve().parents[2]


def native_env(cache_dir) -> dict:
    """The environment of a subprocess that builds kernels ahead of time: TRITON_INTERPRET unset (it must
    be when triton is first imported), this checkout on PYTHONPATH, its own Triton cache (a real build)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    return env


@dataclass
class LensResult:
    error: float          # relative L2 vs float64 attention over the dequantized cache
    bf16_error: float     # the same for plain bf16 attention over those values
    unwritten: int        # output elements still NaN after the call
    out: torch.Tensor
    ref: torch.Tensor


def run_with_lens(attn, spec, lens, tokens: int, dtype: torch.dtype, device, seed: int) -> LensResult:
    """Like foldc.testing.run_case, but with the given per-sequence lengths: fresh random inputs
    and a NaN-poisoned ``out=``."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, _ = random_inputs(spec, len(lens), tokens, dtype, device, gen)
    seq_lens = torch.tensor(lens, device=device)
    sm_scale = 1.0 / math.sqrt(spec.head_dim) * float(0.5 + torch.rand((), generator=gen))
    out = torch.full((len(lens), spec.num_q_heads, spec.head_dim), float("nan"), device=device, dtype=dtype)
    got = attn(q, k, v, sm_scale=sm_scale, seq_lens=seq_lens, out=out)
    assert got is out, "the callable must write into (and return) the out= tensor it was given"
    ref = attention_reference(q, k, v, sm_scale=sm_scale, seq_lens=seq_lens)
    base = bf16_attention(q, k, v, sm_scale, seq_lens)
    return LensResult(rel_l2(got, ref), rel_l2(base, ref), int(torch.isnan(out).sum().item()), got, ref)


def check_graph_replay(attn, spec, seed: int) -> None:
    """Capture one call with device-side seq_lens in a CUDA graph, then replay it as the lengths
    change (as a decode loop does): every replay must write all of ``out`` and match float64."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, _ = random_inputs(spec, 3, 3000, torch.bfloat16, "cuda", gen)
    lens = torch.tensor([1000, 1500, 2000], device="cuda", dtype=torch.int32)
    out = torch.empty(3, spec.num_q_heads, spec.head_dim, device="cuda", dtype=torch.bfloat16)
    attn(q, k, v, seq_lens=lens, out=out)  # compile and tune outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attn(q, k, v, seq_lens=lens, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn(q, k, v, seq_lens=lens, out=out)
    for new in ([1000, 1500, 2000], [1700, 2999, 3000], [1, 2, 3]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        ref = attention_reference(q, k, v, seq_lens=lens.long())
        assert not torch.isnan(out).any(), new
        assert rel_l2(out, ref) < 1e-2, new


class BoundRecorder:
    """Stands in for a `fast_launch.Bound`: records the addresses it is given, launches if ``ok``."""

    def __init__(self, grid=None, dynamic=()):
        self.grid, self.dynamic, self.calls, self.values, self.ok = grid, dynamic, [], [], True

    def __call__(self, addresses, values=()) -> bool:
        self.calls.append(tuple(addresses))
        self.values.append(tuple(values))
        return self.ok

    def then(self, addresses, values, second, addresses2) -> int:
        """As `Bound.then`: this launch, then ``second``'s."""
        if not self(addresses, values):
            return 0
        return 2 if second(addresses2) else 1


class LaunchRecorder:
    """Stands in for a `FastLaunch`: records its ordinary launches and binds a `BoundRecorder` (None where
    ``bindable`` is False)."""

    def __init__(self, bindable: bool = True):
        self.launches, self.bound, self.binds, self.bindable, self.keywords = [], [], 0, bindable, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args))
            self.keywords.append(kwargs)
        return launch

    def bind(self, grid, args, kwargs, dynamic=()):
        self.binds += 1
        if not self.bindable:
            return None
        self.bound.append(BoundRecorder(grid, dynamic))
        return self.bound[-1]


# A script's lines that build the large-m GEMM template (foldc/backends/triton/gemm_dequant.py) ahead of time for
# sm_90 at INT4 g128, 4096 x 4096, fp16, 128 x 128 x 64 tiles: `dequant_build(split_k)` returns the compiled kernel
# (run in a fresh process, TRITON_INTERPRET unset).
DEQUANT_BUILD = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from foldc.backends.runtime.modules import load_module
from foldc.backends.triton.gemm_dequant import SOURCE, unpack_asm


def dequant_build(split_k):
    asm, cons = unpack_asm(4, False)
    sig = {"X": "*fp16", "stride_x": "i32", "WC": "*u8", "stride_w": "i32", "WS": "*fp16", "WZ": "*fp16",
           "stride_ws": "i32", "Y": "*fp16", "stride_y": "i32", "M": "i32", "N": "i32"}
    cx = dict(K=4096, BITS=4, GROUP=128, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, MATH=1, ASM=asm,
              CONS=cons, SPLIT_K=split_k)
    sig.update({k: "constexpr" for k in cx})
    # pointers and strides 16-divisible, as triton specialises a launch on aligned tensors (the pipeline needs it)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(9)}
    return triton.compile(ASTSource(load_module(SOURCE, False).foldc_gemm_dequant, sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
"""
