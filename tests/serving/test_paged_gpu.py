"""Paged decode on a CUDA GPU: no host synchronisation in run() or in a decode step, CUDA-graph
capture and replay (of the wrapper, and of a whole decode step: append + attention over two layers),
results against float64 attention. Skipped without a GPU (CI).

Run: PYTHONPATH=. python3 -m pytest -q tests/serving/test_paged_gpu.py
"""
from __future__ import annotations

import pytest
import torch

import foldc
from foldc.serving import PagedDecodeWrapper, PagedKVCache, QuantizedKVCache, gather_pages
from foldc.testing import bf16_attention, rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90 or sm_100)")

A = foldc.Affine
S = foldc.AttentionSpec
TOLERANCE = 1.10  # x the error of bf16 attention over the same dequantized values
SPECS = {
    "int2 K-token V-channel": S(32, 8, 128, A(2, "token", 128), A(2, "channel", 128)),
    "int4 K-channel V-token": S(32, 8, 128, A(4, "channel", 64), A(4, "token", 128)),
    "int4 token/token": S(32, 8, 128, A(4, "token", 32), A(4, "token", 32)),
}


def _pools(spec, num_pages, page_size, gen):
    k = torch.randn(num_pages, spec.num_kv_heads, page_size, spec.head_dim, generator=gen)
    k[..., :3] *= 6.0
    v = torch.randn(num_pages, spec.num_kv_heads, page_size, spec.head_dim, generator=gen) + 0.5
    return tuple(foldc.quantize(x.cuda(), enc) if enc is not None else x.cuda().bfloat16()   # a plain side: bf16
                 for x, enc in ((k, spec.k), (v, spec.v)))


def _table(lens, page_size, num_pages, gen):
    pages = [max(1, -(-n // page_size)) for n in lens]
    perm = torch.randperm(num_pages, generator=gen)[:sum(pages)]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr.cuda(), perm.to(torch.int32).cuda(), last.cuda()


def _check(spec, q, k_pages, v_pages, indptr, indices, lens, page_size, out):
    k, _ = gather_pages(k_pages, indptr, indices, lens, page_size)
    v, _ = gather_pages(v_pages, indptr, indices, lens, page_size)
    seq = torch.tensor(lens, device="cuda")
    ref = foldc.attention_reference(q, k, v, seq_lens=seq)
    err, base = rel_l2(out, ref), rel_l2(bf16_attention(q, k, v, spec.head_dim ** -0.5, seq), ref)
    assert not torch.isnan(out).any()
    assert err <= TOLERANCE * base, f"{spec.describe()} lens={lens}: {err:.3e} > {TOLERANCE} x {base:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_paged_run_matches_float64_without_host_sync(name, dtype):
    """Both query dtypes run the register-operand kernel on pages, within the bf16 bar."""
    spec, page_size = SPECS[name], 128
    gen = torch.Generator().manual_seed(len(name))
    lens = [4099, 1, 130, 2048, 777, 3000, 129, 4096]
    num_pages = 120
    k_pages, v_pages = _pools(spec, num_pages, page_size, gen)
    indptr, indices, last = _table(lens, page_size, num_pages, gen)
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=4224, device="cuda")
    wrapper.plan(indptr, indices, last, num_pages=num_pages)
    assert wrapper.register_operand
    q = torch.randn(len(lens), spec.num_q_heads, spec.head_dim, generator=gen).cuda().to(dtype)
    wrapper.run(q, k_pages, v_pages)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = wrapper.run(q, k_pages, v_pages)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check(spec, q, k_pages, v_pages, indptr, indices, lens, page_size, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_sequences_sharing_a_prefix_read_its_pages_each(name, dtype):
    """A table whose sequences all list the same prefix of full pages (one copy of a prompt's pages), then pages of
    their own: the register-operand kernel reads the shared pages for each, within the bf16 bar of float64 over the
    tokens gathered apart, through the whole path and the repeated call."""
    spec, page_size, num_pages = SPECS[name], 128, 64
    gen = torch.Generator().manual_seed(7 + len(name))
    k_pages, v_pages = _pools(spec, num_pages, page_size, gen)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    prefix, own = perm[:9], perm[9:]
    lens = [9 * page_size + n for n in (1, 700, 128, 2000)]
    rows = []
    for n in lens:
        mine = -(-n // page_size) - len(prefix)
        rows.append(prefix + own[:mine])
        own = own[mine:]
    indptr = torch.tensor([0] + torch.tensor([len(r) for r in rows]).cumsum(0).tolist(), dtype=torch.int32).cuda()
    indices = torch.tensor([p for r in rows for p in r], dtype=torch.int32).cuda()
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=max(lens), device="cuda")
    wrapper.plan(indptr, indices, None, num_pages=num_pages, seq_lens=lens)
    q = torch.randn(len(lens), spec.num_q_heads, spec.head_dim, generator=gen).cuda().to(dtype)
    out = torch.empty_like(q)
    for _ in range(3):
        q.normal_()
        out.fill_(float("nan"))
        wrapper.run(q, k_pages, v_pages, out=out)
        _check(spec, q, k_pages, v_pages, indptr, indices, lens, page_size, out)


@pytest.mark.parametrize("name", ["int2 K-token V-channel", "int4 token/token"])
def test_eager_runs_go_through_bound_launches_over_new_page_tables(name):
    """Eager runs of one plan's launch bind (the second run) and later ones hand the bound launches the page
    table's addresses per call: runs over re-planned tables (new lengths, new pages, the same buffers) and a
    caller's own lengths each match float64 within the bf16 bar."""
    spec, page_size, num_pages = SPECS[name], 128, 90
    gen = torch.Generator().manual_seed(11)
    k_pages, v_pages = _pools(spec, num_pages, page_size, gen)
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=4096, device="cuda")
    q = torch.randn(3, spec.num_q_heads, spec.head_dim, generator=gen).cuda().bfloat16()
    out = torch.empty_like(q)
    for lens in ([1000, 2000, 300], [4096, 1, 2500], [129, 128, 3333], [77, 4000, 640]):
        indptr, indices, last = _table(lens, page_size, num_pages, gen)
        wrapper.plan(indptr, indices, last, num_pages=num_pages)
        for _ in range(3):
            q.normal_()
            out.fill_(float("nan"))
            wrapper.run(q, k_pages, v_pages, out=out)
            _check(spec, q, k_pages, v_pages, indptr, indices, lens, page_size, out)
    assert wrapper.attention._bindings.bound(), "the paged launches were never bound"
    shorter = [n // 2 + 1 for n in lens]   # the caller's device lengths, same bound launches
    wrapper.run(q, k_pages, v_pages, out=out, seq_lens=torch.tensor(shorter, dtype=torch.int32, device="cuda"))
    _check(spec, q, k_pages, v_pages, indptr, indices, shorter, page_size, out)


def test_captured_run_replays_new_page_tables_planned_into_the_same_buffers():
    spec, page_size, num_pages = SPECS["int2 K-token V-channel"], 128, 80
    gen = torch.Generator().manual_seed(9)
    k_pages, v_pages = _pools(spec, num_pages, page_size, gen)
    wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=4096, device="cuda")
    layouts = [[1000, 2000, 300], [4096, 1, 2500], [129, 128, 3333]]
    tables = [_table(lens, page_size, num_pages, gen) for lens in layouts]
    wrapper.plan(*tables[0], num_pages=num_pages)
    q = torch.randn(3, spec.num_q_heads, spec.head_dim, generator=gen).cuda().bfloat16()
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wrapper.run(q, k_pages, v_pages, out=out)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, k_pages, v_pages, out=out)
    for lens, table in zip(layouts, tables):
        wrapper.plan(*table, num_pages=num_pages)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(spec, q, k_pages, v_pages, table[0], table[1], lens, page_size, out)


@pytest.mark.parametrize("spec, sink, window", [
    (S(32, 8, 128, A(4, "token", 128), A(2, "channel", 64)), 4, 32),
    (S(32, 8, 128, A(4, "token", 128), A(2, "token", 64)), 0, 0),
    (S(32, 8, 128, A(4, "token", 128), A(4, "token", 128)), 0, 0),
], ids=["sink-window-channel", "straight-to-pages-two-encodings", "straight-to-pages-one-encoding"])
def test_captured_decode_step_appends_and_attends_like_the_contiguous_cache(spec, sink, window):
    """append + attention over two layers in one CUDA graph, replayed step after step: the paged
    cache holds the bits the contiguous cache holds, and attention matches float64 (with a plain sink and
    window, and without: tokens straight into the pages)."""
    batch, page_size, layers = 4, 64, 2
    gen = torch.Generator().manual_seed(17)
    cache = PagedKVCache(spec, num_layers=layers, page_size=page_size, num_pages=64, max_seq_len=1024, sink=sink,
                         window=window, device="cuda", dtype=torch.bfloat16)
    assert cache._direct == (sink == window == 0)
    indptr = torch.arange(0, batch * 16 + 1, 16, dtype=torch.int32, device="cuda")
    indices = torch.randperm(64, generator=gen).to(torch.int32).cuda()
    cache.plan(indptr, indices, seq_lens=[0] * batch)
    contiguous = QuantizedKVCache(spec, batch, 1024, sink=sink, window=window, device="cuda", dtype=torch.bfloat16,
                                  target="reference")

    def tokens(n):
        return [(torch.randn(batch, 8, n, 128, generator=gen).cuda().bfloat16(),
                 (torch.randn(batch, 8, n, 128, generator=gen) + 0.5).cuda().bfloat16()) for _ in range(layers)]

    prompt = tokens(300)
    for layer, (k, v) in enumerate(prompt):
        cache.append(layer, k, v)
    contiguous.append(*prompt[1])
    static = tokens(1)
    q = torch.randn(batch, 32, 128, generator=gen).cuda().bfloat16()
    outs = [torch.empty_like(q) for _ in range(layers)]

    def step():
        for layer, (k, v) in enumerate(static):
            cache.append(layer, k, v)
            outs[layer].copy_(cache.attention(layer, q))

    step()  # warm-up (compiles); one token appended outside the graph
    contiguous.append(*static[1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # a decode step does not synchronise
    finally:
        torch.cuda.set_sync_debug_mode("default")
    contiguous.append(*static[1])
    # straight to pages (the register-operand kernel on 64-token pages), both layers' attention went to their
    # prepared runs from the second step; the capture below records what those fall back to (`run`)
    assert sorted(cache._attend_runs) == ([0, 1] if cache._direct else [])
    graph = torch.cuda.CUDAGraph()
    counts = cache.num_tokens(0)
    with torch.cuda.graph(graph):
        step()
    assert cache.num_tokens(0) == counts  # a capture records kernels; before_replay() counts each replay
    for i in range(70):  # crosses channel-group flushes and page boundaries
        for k, v in static:
            k.copy_(torch.randn(batch, 8, 1, 128, generator=gen).cuda())
            v.copy_(torch.randn(batch, 8, 1, 128, generator=gen).cuda() + 0.5)
        cache.before_replay()
        graph.replay()
        contiguous.append(*static[1])
    torch.cuda.synchronize()
    got_k, got_v, lens = cache.dequantized(1)
    want_k, want_v = contiguous.dequantized()
    assert lens == [contiguous.num_tokens] * batch and contiguous.body_tokens > 300
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    ref = foldc.attention_reference(q, want_k, want_v)
    base = rel_l2(bf16_attention(q, want_k, want_v, 128 ** -0.5, torch.tensor(lens, device="cuda")), ref)
    assert rel_l2(outs[1], ref) <= 2 * base


@pytest.mark.parametrize("kw", [dict(k="token:4:128", v="channel:2:64", sink=4, window=32),
                                dict(k="token:4:128", v="token:2:64", sink=0, window=0)],
                         ids=["sink-window-channel", "straight-to-pages"])
def test_paged_hf_cache_holds_the_bits_of_the_contiguous_cache_on_the_gpu(kw):
    """transformers generate (bf16, generated kernels) through PagedFoldcCache, replayed through
    FoldcCache: every layer holds the same bits; the decode logits agree to bf16 rounding."""
    transformers = pytest.importorskip("transformers")
    import foldc.integrations.hf as fhf
    from foldc.integrations.hf_paged import PagedFoldcCache

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=128, vocab_size=256, max_position_embeddings=1024,
                                   initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    model.set_attn_implementation(fhf.ATTN_IMPLEMENTATION)
    ids = torch.randint(3, 256, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()
    paged = PagedFoldcCache(model.config, 400, **kw)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40,
                             do_sample=False, **{fhf.CACHE_KWARG: paged})
        contiguous = fhf.FoldcCache(model.config, 400, **kw)
        logits = []
        for cache in (paged, contiguous):
            cache.reset()
            step = model(out[:, :300], use_cache=True, **{fhf.CACHE_KWARG: cache})
            for t in range(300, out.shape[1] - 1):
                step = model(out[:, t:t + 1], use_cache=True, **{fhf.CACHE_KWARG: cache})
            logits.append(step.logits[:, -1].float())
    for i, (view, layer) in enumerate(zip(paged.layer_caches, contiguous.layer_caches)):
        body = 256 if kw["window"] else out.shape[1] - 1   # without sink and window, every token
        assert view.num_tokens == layer.num_tokens == out.shape[1] - 1 and layer.body_tokens == body
        for got, want in zip(view.dequantized(), layer.dequantized()):
            if i == 0 or kw["window"]:
                assert torch.equal(got, want)
            else:   # straight to pages: a later layer's decode tokens come from the attention before it, whose
                # last bits differ between the paged and the contiguous launch (other splits), and a code can flip
                # there; its prompt tokens (the prefill's attention is the same for both) hold the same bits
                assert torch.equal(got[:, :, :300], want[:, :, :300])
    assert rel_l2(logits[0], logits[1]) < 2e-2


GLUON_CASES = [("int2 packed", S(32, 8, 128, A(2, "token", 128), A(2, "token", 128)), 32),
               ("int2 packed", S(32, 8, 128, A(2, "token", 128), A(2, "token", 128)), 64),
               ("int2 packed", S(32, 8, 128, A(2, "token", 128), A(2, "token", 128)), 256),
               ("int4 packed", S(32, 8, 128, A(4, "token", 128), A(4, "token", 128)), 128),
               ("int2 K-channel", S(32, 8, 128, A(2, "channel", 128), A(2, "token", 128)), 128),
               ("int4 V-channel", S(32, 8, 128, A(4, "token", 128), A(4, "channel", 64)), 64),
               ("int2 g32/g64", S(32, 8, 128, A(2, "token", 32), A(2, "token", 64)), 64),
               ("int2 d64", S(32, 8, 64, A(2, "token", 64), A(2, "channel", 64)), 64),
               ("K4/V2", S(32, 8, 128, A(4, "token", 128), A(2, "token", 128)), 128),
               ("int2 row blocks", S(64, 2, 128, A(2, "token", 128), A(2, "token", 128)), 64),
               ("int4 plain V", S(32, 8, 128, A(4, "token", 128), None), 64),
               ("int2 K-channel g16", S(32, 8, 128, A(2, "channel", 16), A(2, "token", 128)), 32),
               ("int4 V-channel g16", S(32, 8, 128, A(4, "token", 128), A(4, "channel", 16)), 64),
               ("dequant g32", S(64, 4, 128, A(2, "token", 32), A(2, "channel", 32)), 64),
               ("int4 d96 padded", S(32, 8, 96, A(4, "token", 96), A(4, "token", 96)), 64)]


def _gluon_case(spec, page_size: int, seed: int):
    """Ragged sequences (whole cache, 1 token, around a tile and a page) on shuffled pages with spare
    pages, and their query: (lens, num_pages, k_pages, v_pages, indptr, indices, last_page_len, q)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [5000, 1, 31, 33, page_size, page_size + 1, 2047]
    num_pages = sum(-(-n // page_size) for n in lens) + 7
    k_pages, v_pages = _pools(spec, num_pages, page_size, gen)
    indptr, indices, last = _table(lens, page_size, num_pages, gen)
    q = torch.randn(len(lens), spec.num_q_heads, spec.head_dim, generator=gen).cuda().bfloat16()
    return lens, num_pages, k_pages, v_pages, indptr, indices, last, q


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the register-operand kernel needs sm_90")
@pytest.mark.parametrize("name,spec,page_size", GLUON_CASES, ids=[f"{n}-P{p}" for n, _, p in GLUON_CASES])
def test_register_operand_kernel_reads_pages_like_the_triton_kernel(name, spec, page_size):
    """kernel="auto" takes the register-operand kernel on sm_90; its paged reads (a page per tile,
    splits that start mid-page, sequences shorter than a tile) give the float64 answer and the
    generated Triton kernel's answer over the same pages."""
    lens, num_pages, k_pages, v_pages, indptr, indices, last, q = _gluon_case(spec, page_size, page_size + len(name))
    outs = {}
    # a head_dim between powers of two (padded in the registers) has no Triton kernel: float64 only
    kernels = ("auto", "triton") if spec.head_dim & (spec.head_dim - 1) == 0 else ("auto",)
    for kernel in kernels:
        wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=5120, device="cuda", splits=7, kernel=kernel)
        assert wrapper.register_operand == (kernel == "auto")
        wrapper.plan(indptr, indices, last, num_pages=num_pages)
        outs[kernel] = wrapper.run(q, k_pages, v_pages)
    _check(spec, q, k_pages, v_pages, indptr, indices, lens, page_size, outs["auto"])
    if "triton" in outs:
        assert rel_l2(outs["auto"], outs["triton"].double()) <= 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the register-operand kernel needs sm_90")
@pytest.mark.parametrize("name,spec,page_size", GLUON_CASES[1:5], ids=[f"{n}-P{p}" for n, _, p in GLUON_CASES[1:5]])
def test_register_operand_kernel_draws_paged_tiles_dynamically(name, spec, page_size):
    """The kernel with dynamic tiles (GluonAttention's dynamic_tiles) over pages: each drawn tile finds
    its page; the float64 answer, and the static kernel's answer to within rounding."""
    lens, num_pages, k_pages, v_pages, indptr, indices, last, q = _gluon_case(spec, page_size, page_size + 3)
    outs = {}
    for dynamic in (True, False):
        wrapper = PagedDecodeWrapper(spec, page_size, max_seq_len=5120, device="cuda", splits=7, kernel="gluon",
                                     dynamic_tiles=dynamic)
        wrapper.plan(indptr, indices, last, num_pages=num_pages)
        assert all(launch.options["constexprs"]["DYNAMIC"] == dynamic for launch in wrapper._launches.values())
        outs[dynamic] = wrapper.run(q, k_pages, v_pages)
    _check(spec, q, k_pages, v_pages, indptr, indices, lens, page_size, outs[True])
    assert rel_l2(outs[True], outs[False].double()) <= 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_gpu_cache_rejects_nan_and_inf_in_either_operand_and_keeps_its_tokens(dtype, bad):
    """The append's check of both operands at once (one fused max |x|, one sync) on the GPU: a NaN, +Inf or
    -Inf anywhere in k or v is refused with the first index named, and the cache attends as before."""
    spec = foldc.AttentionSpec(8, 2, 128, foldc.Affine(4, "token", 128), foldc.Affine(2, "token", 128))
    gen = torch.Generator(device="cuda").manual_seed(5)
    cache = QuantizedKVCache(spec, 2, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, 20, 128, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    cache.append(k, v)
    q = torch.randn(2, 8, 128, device="cuda", dtype=dtype, generator=gen)
    before = cache.attention(q)
    for side in ("k_new", "v_new"):
        k1, v1 = (torch.randn(2, 2, 3, 128, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        (k1 if side == "k_new" else v1)[1, 0, 2, 77] = bad
        with pytest.raises(foldc.InputError, match=rf"{side} holds NaN or Inf \(first at index \[1, 0, 2, 77\]\)"):
            cache.append(k1, v1)
    assert cache.num_tokens == 20 and torch.equal(cache.attention(q), before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("v_enc", ["token:2:64", "token:4:128"], ids=["two encodings", "one encoding"])
def test_a_one_token_nan_on_the_gpu_is_flagged_without_a_sync(dtype, v_enc):
    """Decode steps read nothing back: with sync debug mode set to error, one-token appends (bound launches
    from the third on; one pair launch for K and V, of one encoding or two) and attention run; a NaN token is flagged
    by the append kernel straight into host memory (the flag is pinned host memory the kernel writes through
    its device address), and once the GPU has run it every call of the cache raises, until reset()."""
    from foldc.encoding import parse_affine

    spec = foldc.AttentionSpec(8, 2, 128, foldc.Affine(4, "token", 128), parse_affine(v_enc))
    gen = torch.Generator(device="cuda").manual_seed(7)
    cache = QuantizedKVCache(spec, 2, 64, device="cuda", dtype=dtype)
    assert cache._flag_mapped and cache._flag.is_cuda and cache._flag.data_ptr() == cache._flag_host.data_ptr()
    assert cache._pair
    cache.append(*(torch.randn(2, 2, 9, 128, device="cuda", dtype=dtype, generator=gen) for _ in range(2)))
    q = torch.randn(2, 8, 128, device="cuda", dtype=dtype, generator=gen)
    steps = [[torch.randn(2, 2, 1, 128, device="cuda", dtype=dtype, generator=gen) for _ in range(2)]
             for _ in range(5)]
    steps[4][1][0, 1, 0, 100] = float("nan")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k1, v1 in steps[:4]:
            cache.append(k1, v1)
            cache.attention(q)
        cache.append(*steps[4])   # the NaN (the next call raises once the kernel's flag has landed: not yet read)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with pytest.raises(foldc.InputError, match="a one-token append held NaN or Inf"):
        cache.attention(q)
    with pytest.raises(foldc.InputError, match="a one-token append held NaN or Inf"):
        cache.check()
    cache.reset()
    cache.append(*steps[0])
    assert torch.isfinite(cache.attention(q)).all()


@pytest.mark.parametrize("kv", [("token:4:128", "token:2:64"), ("token:2:32", "channel:2:16"),
                                ("token:4:32", "token:4:32")])
def test_one_token_appends_through_bound_launches_write_what_quantize_gives(kv):
    """A decode loop's body writes: from the third write of one shape on, the append kernel is launched bound,
    the token offset given per call (`FastLaunch.bind(dynamic=...)`). Every token's codes, scales and zeros
    equal foldc.quantize of the same tokens, and the cache's attention stays within the bf16 bar."""
    from foldc.encoding import parse_affine

    k_enc, v_enc = (parse_affine(t) for t in kv)
    spec = foldc.AttentionSpec(8, 2, 128, k_enc, v_enc)
    gen = torch.Generator(device="cuda").manual_seed(11)
    cache = QuantizedKVCache(spec, 2, 128, device="cuda", dtype=torch.bfloat16)
    ks, vs = [], []
    for n in [16] + [1] * 64:
        k, v = (torch.randn(2, 2, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
    assert cache._append_bindings.bound(), "no body write was bound"
    assert (cache._token_write is not None) == cache._pair, "the decode steps' fast path (K and V in one launch)"
    assert cache.body_tokens == cache.num_tokens == 80
    for name, x, enc, got in zip(("k", "v"), (torch.cat(ks, 2), torch.cat(vs, 2)), (k_enc, v_enc), cache.body()):
        want = foldc.quantize(x, enc)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale), name
        assert torch.equal(got.zero, want.zero), name
    q = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_body, v_body = cache.body()
    seq = torch.full((2,), cache.num_tokens, dtype=torch.int32, device="cuda")
    ref = foldc.attention_reference(q, k_body, v_body, seq_lens=seq)
    bar = rel_l2(bf16_attention(q, k_body, v_body, 128 ** -0.5, seq), ref)
    assert rel_l2(cache.attention(q), ref) <= 2 * bar + 1e-4


@pytest.mark.parametrize("kv,heads,window", [("token:4:128", "16/4", 0), ("token:2:128", "64/2", 0),
                                             ("token:4:32", "32/8", 3), ("channel:4:32", "32/8", 0)],
                         ids=["int4", "int2 warpgroup", "int4 g32 window", "channel-wise"])
def test_attention_at_every_length_through_one_launch_plan(kv, heads, window):
    """A decode loop's attention: one launch plan for the whole loop, the token count given to the bound kernels
    per call (no lengths tensor), every step within the bf16 bar of float64 over the cache's dequantized tokens
    (the warpgroup template at 32 query rows per KV head too)."""
    from foldc.encoding import parse_affine

    enc = parse_affine(kv)
    q_heads, kv_heads = (int(x) for x in heads.split("/"))
    spec = foldc.AttentionSpec(q_heads, kv_heads, 128, enc, enc)
    gen = torch.Generator(device="cuda").manual_seed(5)
    cache = QuantizedKVCache(spec, 1, 512, window=window, device="cuda", dtype=torch.bfloat16)
    cache.append(*(torch.randn(1, kv_heads, 40, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(2)))
    for step in range(24):
        cache.append(*(torch.randn(1, kv_heads, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for _ in range(2)))
        q = torch.randn(1, q_heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        got = cache.attention(q)
        k, v = cache.dequantized()
        ref = foldc.compile(foldc.AttentionSpec(q_heads, kv_heads, 128), "reference")(q, k, v, sm_scale=128 ** -0.5)
        seq = torch.full((1,), k.shape[2], dtype=torch.int32, device="cuda")
        bar = rel_l2(bf16_attention(q, k, v, 128 ** -0.5, seq), ref)
        assert rel_l2(got, ref) <= 2 * bar + 1e-4, f"step {step}"
    body = cache._body_attention
    if type(body).__name__ == "GluonAttention":
        assert len(body._launches) >= 1 and all(not launch.has_lens for launch in body._launches.values())
        bound = body._bindings.bound() + (body.warpgroup._bindings.bound() if body.warpgroup else [])
        assert bound, "the body's attention was never bound"
        assert (cache._attend is not None) == (not window), "a body-only decode step's fast path"
    assert "body" not in cache._lens, "the body's attention filled a lengths tensor"


@pytest.mark.parametrize("layout", ["token", "channel"])
def test_append_paged_on_the_gpu_reads_no_table_entry_past_kv_indices(layout):
    """A GPU kv_indptr running past its kv_indices (the head of a longer table whose tail names real pages) is not
    checked on the host (a sync): the kernels write only the tokens whose entries lie inside kv_indices, as the
    reference does with kv_indptr clipped to the table's length; before, they wrote into the pages after it."""
    from foldc.serving import append_paged, page_pool

    gen = torch.Generator().manual_seed(23)
    spec = S(4, 2, 64, A(4, layout, 32 if layout == "token" else 16), A(4, layout, 32 if layout == "token" else 16))
    full = torch.randperm(10, generator=gen).to(torch.int32)
    x = torch.randn(2, 2, 64, 64, generator=gen).half()
    indptr = torch.tensor([0, 1, 4], dtype=torch.int32)   # sequence 1: entry 1 of a table of 2, then 2 past it
    start = torch.zeros(2, dtype=torch.int32)
    pools = []
    for device, table, target in (("cuda", indptr, "auto"), ("cpu", indptr.clamp(max=2), "reference")):
        pool = page_pool(spec, "k", 10, 16, device=device)
        for part in (pool.codes, pool.scale, pool.zero):
            part.copy_(torch.randint(0, 200, part.shape, generator=torch.Generator().manual_seed(5)))
        append_paged(pool, x.to(device), table.to(device), full.to(device)[:2], start.to(device), page_size=16,
                     target=target)
        pools.append(pool)
    torch.cuda.synchronize()
    for name in ("codes", "scale", "zero"):
        assert torch.equal(getattr(pools[0], name).cpu(), getattr(pools[1], name)), name
