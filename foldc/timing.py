"""Timing on a GPU the way serving engines run a decode step: captured once into a CUDA graph and
replayed (eager calls of small shapes time the host's launch path instead of the kernels)."""
from __future__ import annotations

import torch


def capture_graph(fn, warmup_calls: int = 3) -> torch.cuda.CUDAGraph:
    """``fn`` run a few times on a side stream (compiles, allocator pools), then captured; raises
    what the capture raises when ``fn`` cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def host_us(fn, calls: int = 200) -> float:
    """Median host microseconds of one call of ``fn`` made on an idle GPU: the launch returns before
    the kernels run, so this is the host's launch path alone (the GPU is synchronised before each)."""
    import statistics
    import time

    fn()
    took = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        took.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(took) * 1e6


def back_to_back_us(fn, calls: int = 300, warmup: int = 10, repeats: int = 5) -> float:
    """Median over ``repeats`` bursts of the µs per call of ``calls`` calls of ``fn`` issued without waiting
    (the GPU synchronised before and after each burst): the slower of the host's launch path and the
    GPU's time per call, what an eager loop sees (no L2 flush between calls)."""
    import statistics
    import time

    for _ in range(warmup):
        fn()
    took = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        took.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(took)


def graph_us(fn) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph, L2 flushed between replays (triton's
    ``do_bench``): the GPU time of one decode step as a serving engine runs it."""
    from triton.testing import do_bench

    fn()
    graph = capture_graph(fn)
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
