"""PagedKVCache: the paged body plus plain sink/window holds exactly what the contiguous
QuantizedKVCache holds for the same tokens (same bits), and its attention (paged kernel merged with
the plain window by log-sum-exp) matches float64 attention over the dequantized cache."""
from __future__ import annotations

import copy

import pytest
import torch

import foldc
from foldc.errors import InputError, InputTypeError, SpecError
from foldc.serving import PagedKVCache, QuantizedKVCache
from foldc.testing import rel_l2

A = foldc.Affine
S = foldc.AttentionSpec
TOL = 2e-3
# the interpreter's 0/0 and log2(0) for a sequence whose body is still empty (merged away by lse = -inf)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning",
                                        "ignore:divide by zero encountered in log2:RuntimeWarning")


def _table(batch: int, pages_each: int, num_pages: int, seed: int):
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[:batch * pages_each]
    return torch.arange(0, batch * pages_each + 1, pages_each, dtype=torch.int32), perm.to(torch.int32)


def _tokens(gen, batch, heads, count, head_dim):
    k = torch.randn(batch, heads, count, head_dim, generator=gen)
    k[..., 3] *= 6.0  # an outlier key channel
    return k.half(), (torch.randn(batch, heads, count, head_dim, generator=gen) + 0.5).half()


@pytest.mark.parametrize("spec, sink, window, prefill, steps, target", [
    (S(4, 2, 64, A(2, "token", 32), A(4, "channel", 16)), 2, 8, 40, 20, "interpret"),
    (S(4, 2, 64, A(4, "channel", 32), A(2, "token", 64)), 0, 0, 30, 8, "interpret"),
    (S(2, 1, 64, A(2, "token", 16), A(4, "token", 16)), 3, 4, 1, 12, "interpret"),
    (S(4, 2, 64, A(2, "channel", 16), A(2, "channel", 32)), 1, 16, 70, 10, "reference"),
    (S(4, 2, 64, A(2, "token", 32), A(4, "token", 64)), 0, 0, 21, 14, "interpret"),
    (S(4, 1, 64, A(4, "token", 64), A(2, "token", 16)), 0, 0, 1, 10, "reference"),
], ids=["token2-channel4-sink-window", "channel4-token2-no-window", "token-token-tiny-prompt", "reference-target",
        "token-token-straight-to-pages", "reference-straight-to-pages"])
def test_paged_cache_holds_the_same_bits_as_the_contiguous_cache(spec, sink, window, prefill, steps, target):
    batch, page_size = 3, 32
    gen = torch.Generator().manual_seed(prefill * 31 + steps)
    cache = PagedKVCache(spec, num_layers=2, page_size=page_size, num_pages=16, max_seq_len=128, sink=sink,
                         window=window, target=target)
    cache.plan(*_table(batch, 4, 16, seed=steps), seq_lens=[0] * batch)
    contiguous = QuantizedKVCache(spec, batch, 128, sink=sink, window=window, target="reference")
    k, v = _tokens(gen, batch, spec.num_kv_heads, prefill, spec.head_dim)
    for layer in range(2):
        cache.append(layer, k, v)
    contiguous.append(k, v)
    for step in range(steps):
        k, v = _tokens(gen, batch, spec.num_kv_heads, 1, spec.head_dim)
        for layer in range(2):
            cache.append(layer, k, v)
        contiguous.append(k, v)
        if step % 9 == 8 or step == steps - 1:
            want_k, want_v = contiguous.dequantized()
            for layer in range(2):
                got_k, got_v, lens = cache.dequantized(layer)
                assert lens == [contiguous.num_tokens] * batch
                assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (step, layer)
            q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).half()
            ref = foldc.attention_reference(q, want_k, want_v)
            assert rel_l2(cache.attention(1, q), ref) <= TOL
    assert contiguous.body_tokens > 0, "the case must reach the quantized body"


def test_each_sequence_keeps_its_own_length_across_a_replan():
    """Sequences of different lengths: planned again with the tokens they hold, they keep growing."""
    spec = S(4, 2, 64, A(4, "token", 32), A(4, "token", 32))
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(spec, num_layers=1, page_size=16, num_pages=12, max_seq_len=64, sink=1, window=4)
    indptr, indices = _table(2, 4, 12, seed=1)
    cache.plan(indptr, indices, seq_lens=[0, 0])
    k, v = _tokens(gen, 2, 2, 20, 64)
    cache.append(0, k, v)
    cache.plan(indptr, indices, seq_lens=[20, 0])    # sequence 1 starts again, empty
    k2, v2 = _tokens(gen, 2, 2, 1, 64)
    cache.append(0, k2, v2)
    got_k, got_v, lens = cache.dequantized(0)
    assert lens == [21, 1]
    q = torch.randn(2, 4, 64, generator=gen).half()
    out = cache.attention(0, q)
    keys = torch.cat([k[:1], k2[:1]], 2)[0].float()           # sequence 0: sink 1, body 16, recent 4
    assert cache.body_len(21) == 16
    assert torch.equal(got_k[0, :, :1], keys[:, :1]) and torch.equal(got_k[0, :, 17:21], keys[:, 17:])
    assert torch.equal(got_k[0, :, 1:17], foldc.quantize(keys[None, :, 1:17], spec.k).dequantize()[0])
    ref = foldc.attention_reference(q, got_k, got_v, seq_lens=torch.tensor(lens))
    assert rel_l2(out, ref) <= TOL
    assert torch.equal(got_k[1, :, :1], k2[1].float())  # a new sequence's first token is plain (the sink)


def test_before_replay_advances_the_host_counts_and_refuses_past_capacity():
    spec = S(2, 1, 64, A(4, "token", 64), A(4, "token", 64))
    cache = PagedKVCache(spec, num_layers=2, page_size=16, num_pages=4, max_seq_len=40, window=2)
    cache.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), seq_lens=[0])
    cache.append(0, *_tokens(torch.Generator().manual_seed(0), 1, 1, 17, 64))
    cache.append(1, *_tokens(torch.Generator().manual_seed(0), 1, 1, 17, 64))
    cache.before_replay()
    assert cache.num_tokens(0) == cache.num_tokens(1) == [18]
    with pytest.raises(InputError, match=r"goes past capacity: its body needs 17 token slots but its 1 pages hold 16"):
        cache.before_replay()
    assert cache.num_tokens(1) == [18]


@pytest.mark.parametrize("tokens", [-1, -5, 2.5, True, "1", None])
def test_before_replay_refuses_a_token_count_that_is_not_a_whole_number_of_tokens(tokens):
    """before_replay(-1) moved every host count back (the device's moved on): later host-planned appends wrote at
    the wrong positions, silently; a bool was taken as 1, a float or a string raised from the arithmetic."""
    spec = S(2, 1, 64, A(4, "token", 64), A(4, "token", 64))
    cache = PagedKVCache(spec, num_layers=2, page_size=16, num_pages=4, max_seq_len=40, window=2)
    cache.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), seq_lens=[0])
    held = int(torch.randint(1, 17, ()))
    for layer in range(2):
        cache.append(layer, *_tokens(torch.Generator().manual_seed(held), 1, 1, held, 64))
    with pytest.raises(SpecError, match=rf"tokens={tokens!r} must be an integer >= 0"):
        cache.before_replay(tokens)
    assert cache.num_tokens(0) == cache.num_tokens(1) == [held]


CACHE_SPEC = S(4, 2, 64, A(2, "token", 32), A(4, "channel", 16))


def _small_cache(**kw):
    cache = PagedKVCache(CACHE_SPEC, num_layers=1, page_size=16, num_pages=4, max_seq_len=40, **kw)
    cache.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), seq_lens=[0])
    return cache


@pytest.mark.parametrize("call, exc, match", [
    (lambda c: c.append(0, *_tokens(torch.Generator(), 1, 2, 41, 64)), InputError,
     r"appending 41 tokens to sequence 0 \(0 tokens\) goes past capacity: max_seq_len=40"),
    (lambda c: c.append(0, *_tokens(torch.Generator(), 1, 2, 33, 64)), InputError,
     r"goes past capacity: its body needs 32 token slots but its 1 pages hold 16; plan\(\) again"),
    (lambda c: c.append(0, *_tokens(torch.Generator(), 1, 4, 3, 64)), InputError,
     r"k_new shape=\(1, 4, 3, 64\) but this cache holds \[1, 2, tokens, 64\].*mismatched heads"),
    (lambda c: c.append(0, torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 3, 64).half()),
     InputError, r"k_new dtype=torch.bfloat16 but the cache was built with dtype=torch.float16"),
    (lambda c: c.append(1, *_tokens(torch.Generator(), 1, 2, 3, 64)), InputError, r"layer=1 must be .* \[0, 0\]"),
    (lambda c: c.attention(0, torch.zeros(1, 2, 64).half()), InputError, r"q shape=\(1, 2, 64\) but .*\(1, 4, 64\)"),
    (lambda c: c.attention(0, torch.zeros(1, 4, 64).half()), InputError,
     r"sequence 0 of layer 0 holds no tokens; append\(\) its keys and values before attention\(\)"),
    (lambda c: c.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                      seq_lens=[41]), InputError, r"seq_lens\[0\]=41 must lie in \[0, max_seq_len=40\]"),
])
def test_bad_cache_calls_name_the_value_and_the_fix(call, exc, match):
    with pytest.raises(exc, match=match):
        call(_small_cache(window=1))


def test_a_plain_operand_and_a_bad_replan_are_refused():
    with pytest.raises(SpecError, match=r"quantizes both K and V into pages"):
        PagedKVCache(S(4, 2, 64, A(2, "token", 32), None), num_layers=1, page_size=16, num_pages=4, max_seq_len=8)
    cache = _small_cache()
    cache.append(0, *_tokens(torch.Generator(), 1, 2, 5, 64))
    with pytest.raises(InputError, match=r"seq_lens\[0\]=7 but layer 0 holds 5 tokens of sequence 0"):
        cache.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), seq_lens=[7])


def test_a_replan_with_too_few_pages_names_the_lengths_it_was_given():
    """The check named the body's length as if it were the caller's: ``seq_lens[0]=24`` for seq_lens=[30]."""
    cache = PagedKVCache(S(4, 2, 64, A(4, "token", 32), A(4, "token", 32)), num_layers=1, page_size=16,
                         num_pages=8, max_seq_len=64, sink=2, window=4, target="interpret")
    cache.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32), seq_lens=[0])
    cache.append(0, *_tokens(torch.Generator().manual_seed(4), 1, 2, 30, 64))
    with pytest.raises(InputError, match=r"seq_lens\[0\]=30 puts 24 tokens in the quantized body \(sink=2, "
                                         r"window=4\) but sequence 0 owns 1 pages of page_size=16 \(16 tokens\); "
                                         r"give it at least 2 pages in kv_indices"):
        cache.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), seq_lens=[30])
    assert cache.num_tokens() == [30] and cache.table.pages == (2,)   # the refused plan changed nothing


def test_the_paged_example_runs_and_matches_float64(capsys):
    """examples/paged_decode.py, two decode steps (CPU: Triton's interpreter)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "paged_decode.py"
    spec = importlib.util.spec_from_file_location("paged_decode_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--steps", "2"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    assert len(lines) == 1 and "73 tokens per sequence" in lines[0]
    assert float(lines[0].rsplit(" ", 1)[1]) <= TOL


@pytest.fixture
def no_host_reads(monkeypatch):
    """Within the block, reading a tensor's value on the host (bool/int/float/item/tolist: what a device
    sync or data-dependent branch needs) fails the test: the CPU stand-in for CUDA's sync debug mode."""
    import contextlib

    @contextlib.contextmanager
    def block():
        with monkeypatch.context() as m:
            for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist"):
                m.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host read: Tensor.{_n}"))
            yield
    return block


def test_run_and_a_decode_step_read_nothing_on_the_host(no_host_reads):
    spec = S(4, 2, 64, A(2, "token", 32), A(4, "channel", 16))
    gen = torch.Generator().manual_seed(8)
    cache = PagedKVCache(spec, num_layers=1, page_size=32, num_pages=8, max_seq_len=128, sink=2, window=8)
    cache.plan(*_table(2, 4, 8, seed=2), seq_lens=[0, 0])
    cache.append(0, *_tokens(gen, 2, 2, 40, 64))
    k, v = _tokens(gen, 2, 2, 1, 64)
    q = torch.randn(2, 4, 64, generator=gen).half()
    with no_host_reads():
        for _ in range(3):  # the second step flushes a group of 16 tokens into the pages
            cache.append(0, k, v)
            out = cache.attention(0, q)
    keys, values, lens = cache.dequantized(0)
    assert lens == [43, 43] and cache.body_len(41) == 16 and cache.body_len(43) == 32
    assert rel_l2(out, foldc.attention_reference(q, keys, values)) <= TOL


@pytest.mark.parametrize("kv", [(A(4, "token", 32), A(2, "token", 64)), (A(4, "token", 64), A(2, "token", 64)),
                                (A(4, "token", 32), A(4, "token", 32))],
                         ids=["two-encodings", "4-and-2-bits-g64", "one-encoding"])
def test_without_sink_and_window_decode_tokens_go_straight_to_the_pages(no_host_reads, monkeypatch, kv):
    """Token-wise groups, no sink, no window: the body holds every token, so a decode step writes its token into
    the pages (no plain buffer) and attention reads the pages alone (no plain attention, no merge), on the
    device only; the result still matches float64 over the dequantized cache, at every step. K and V go in one
    append launch (the kernel's pair mode, each in its own encoding), also when the value is a transposed view (its
    token's stride differs from the key's, as transformers makes them)."""
    import foldc.serving.paged_cache as paged_cache

    def never(*args, **kwargs):
        raise AssertionError("the straight-to-pages path has no plain part")

    monkeypatch.setattr(paged_cache, "launch_plain", never)
    monkeypatch.setattr(paged_cache, "merge_two_parts", never)
    spec = S(4, 2, 64, *kv)
    gen = torch.Generator().manual_seed(12)
    cache = PagedKVCache(spec, num_layers=1, page_size=16, num_pages=8, max_seq_len=64)
    assert cache._pair
    cache.plan(*_table(2, 3, 8, seed=4), seq_lens=[0, 0])
    cache.append(0, *_tokens(gen, 2, 2, 14, 64))
    monkeypatch.setattr(paged_cache, "append_paged", never)   # decode steps: one launch for both, never one each
    pairs = []
    real = paged_cache.run_append
    monkeypatch.setattr(paged_cache, "run_append",
                        lambda launch, *a, **kw: pairs.append(dict(launch.constants)) or real(launch, *a, **kw))
    for step in range(4):   # the third step crosses into each sequence's second page
        k, v = _tokens(gen, 2, 2, 1, 64)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)   # [2, 2, 1, 64] as a transposed view
        q = torch.randn(2, 4, 64, generator=gen).half()
        with no_host_reads():
            cache.append(0, k, v)
            out = cache.attention(0, q)
        keys, values, lens = cache.dequantized(0)
        assert lens == [15 + step] * 2 and cache.body_len(15 + step) == 15 + step
        assert torch.equal(keys[:, :, -1:], foldc.quantize(k.float(), spec.k).dequantize().to(keys.dtype))
        assert torch.equal(values[:, :, -1:], foldc.quantize(v.float(), spec.v).dequantize().to(values.dtype))
        assert rel_l2(out, foldc.attention_reference(q, keys, values)) <= TOL
    assert len(pairs) == 4 and all(c["PAIR"] and c["ADVANCE"] and (c["BITS"], c["GROUP"], c["BITS2"], c["GROUP2"]) ==
                                   (kv[0].bits, kv[0].group_size, kv[1].bits, kv[1].group_size) for c in pairs)


def test_lengths_cannot_claim_tokens_the_cache_never_received():
    cache = _small_cache()
    table = (torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32))
    with pytest.raises(InputError, match=r"seq_lens\[0\]=40 but layer 0 holds 0 tokens of sequence 0"):
        cache.plan(*table, seq_lens=[40, 40])
    cache.plan(*table, seq_lens=[0, 0])
    with pytest.raises(InputError, match=r"seq_lens\[1\]=3 but layer 0 holds 0 tokens"):
        cache.plan(*table, seq_lens=[0, 3])
    with pytest.raises(InputTypeError, match=r"seq_lens='4' must be a list of ints"):
        cache.plan(*table, seq_lens="4")
    with pytest.raises(InputError, match=r"seq_lens dtype=torch.float32"):
        cache.plan(*table, seq_lens=[1.5, 2.0])


def test_a_growing_batch_keeps_the_tokens_of_the_sequences_it_held():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(S(4, 2, 64, A(2, "token", 32), A(4, "channel", 16)), num_layers=1, page_size=16,
                         num_pages=8, max_seq_len=40, sink=2, window=3, target="reference")
    cache.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), seq_lens=[0])
    k, v = _tokens(gen, 1, 2, 9, 64)
    cache.append(0, k, v)
    before_k, before_v, _ = cache.dequantized(0)
    cache.plan(torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 1, 4, 5], dtype=torch.int32),
               seq_lens=[9, 0])
    k2, v2 = _tokens(gen, 2, 2, 9, 64)
    after_k, after_v, lens = cache.dequantized(0)
    assert lens == [9, 0]
    assert torch.equal(after_k[:1, :, :9], before_k) and torch.equal(after_v[:1, :, :9], before_v)


@pytest.mark.parametrize("target", ["interpret", "reference"])
def test_nan_tokens_are_refused_on_the_host_and_propagate_as_nan_on_the_device(target):
    """A prefill (host-planned) and every reference-target append refuse NaN; a device-only decode
    step cannot check, and there the NaN reaches attention as NaN, also after it is flushed into the
    quantized body, never as zeros or a finite mix."""
    gen = torch.Generator().manual_seed(9)
    spec = S(4, 2, 64, A(2, "token", 32), A(4, "token", 64))
    cache = PagedKVCache(spec, num_layers=1, page_size=16, num_pages=8, max_seq_len=64, sink=1, window=2,
                         target=target)
    cache.plan(torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 1, 2, 3], dtype=torch.int32),
               seq_lens=[0, 0])
    k, v = _tokens(gen, 2, 2, 12, 64)
    bad = k.clone()
    bad[0, 1, 4, 7] = float("nan")
    with pytest.raises(InputError, match=r"k_new holds NaN or Inf \(first at index \[0, 1, 4, 7\]\)"):
        cache.append(0, bad, v)
    assert cache.num_tokens(0) == [0, 0]
    cache.append(0, k, v)
    step_k, step_v = _tokens(gen, 2, 2, 1, 64)
    step_v[1, 0, 0, 5] = float("nan")
    if target == "reference":
        with pytest.raises(InputError, match="v_new holds NaN or Inf"):
            cache.append(0, step_k, step_v)
    else:
        cache.append(0, step_k, step_v)
        q = torch.randn(2, 4, 64, generator=gen).half()
        for _ in range(4):   # the window (2 + 1) overflows: the NaN token is flushed into the body
            out = cache.attention(0, q)
            # value channel 5 of KV head 0 is NaN: query heads 0-1 of sequence 1 there (the whole group once
            # it is quantized), nothing else
            assert torch.isnan(out[1, :2, 5]).all() and torch.isfinite(out[1, 2:]).all() and torch.isfinite(out[0]).all()
            cache.append(0, *_tokens(gen, 2, 2, 1, 64))
        k_all, v_all, _ = cache.dequantized(0)
        assert torch.isnan(v_all[1, 0]).any()


@pytest.mark.parametrize("spec", [S(4, 2, 64, A(2, "token", 32), A(4, "token", 64)),
                                  S(4, 2, 64, A(4, "channel", 16), A(2, "token", 32))], ids=["token", "channel"])
@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the append kernels)"))])
def test_a_prefill_whose_scales_would_overflow_is_refused_before_anything_is_written(monkeypatch, spec, name, device):
    """A bfloat16 prefill holding a value whose group's scale or zero overflows the fp16 scales: the prefill wrote
    each sequence's flushed tokens in turn, unchecked on the GPU (the append kernel stored an inf scale: attention
    NaN) and, by foldc.quantize, refused by target "reference" midway, earlier sequences' pages written. Refused
    now with foldc.quantize's error, naming the layer, sequence and operand, before any write (the writer is never
    called), as QuantizedKVCache refuses it; the cache is as it was and takes the prefill without the value. On a GPU
    the pages take the append kernels (target "auto"), on the CPU target "reference"."""
    from foldc.errors import ScaleOverflowError
    import foldc.serving.paged_cache as paged_cache

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    cache = PagedKVCache(spec, num_layers=2, page_size=16, num_pages=12, max_seq_len=64, sink=2, window=4,
                         dtype=torch.bfloat16, device=device, target="reference" if device == "cpu" else "auto")
    cache.plan(*(t.to(device) for t in _table(3, 4, 12, seed=3)), seq_lens=[0] * 3)
    k, v = (t.bfloat16().to(device) for t in _tokens(gen, 3, 2, 10, 64))
    for layer in range(2):
        cache.append(layer, k, v)
    k, v = (t.bfloat16().to(device) for t in _tokens(gen, 3, 2, 40, 64))
    bad_b = int(torch.randint(0, 3, (), generator=gen))
    bad = {"k": k.clone(), "v": v.clone()}
    bad[name][bad_b, 1, 5, 9] = 3e6   # token 15 of the sequence: past the sink, flushed into the pages
    before = [[t.clone() for pool in layer.values() for t in (pool.codes, pool.scale, pool.zero)]
              for layer in cache.pools]
    held = [cache.dequantized(layer) for layer in range(2)]
    writes = []
    real = paged_cache.append_paged
    monkeypatch.setattr(paged_cache, "append_paged", lambda *a, **kw: (writes.append(1), real(*a, **kw)))
    operand = "keys" if name == "k" else "values"
    with pytest.raises(ScaleOverflowError, match=rf"layer 1, sequence {bad_b}: the {operand} this prefill moves into "
                                                 r"the pages cannot be quantized: x has values .* whose scale or zero "
                                                 r"overflow scale_dtype=torch.float16; use float32 scales"):
        cache.append(1, bad["k"], bad["v"])
    assert writes == [] and cache.num_tokens(1) == [10] * 3
    after = [t for pool in cache.pools[1].values() for t in (pool.codes, pool.scale, pool.zero)]
    assert all(torch.equal(a, b) for a, b in zip(after, before[1]))
    got = cache.dequantized(1)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], held[1][:2])) and got[2] == held[1][2]
    cache.append(1, k, v)
    assert writes and cache.num_tokens(1) == [50] * 3


def test_device_lengths_past_a_sequences_pages_read_only_its_pages():
    """run(seq_lens=...) is not checked on the host (that needs a sync): a length past the pages a
    sequence owns must still read only those pages: the answer is attention over them, never a read
    past the page table (here the last sequence's pages end the table)."""
    from foldc.serving import PagedDecodeWrapper, gather_pages

    spec = S(4, 2, 64, A(2, "token", 32), A(4, "token", 64))
    gen = torch.Generator().manual_seed(5)
    w = PagedDecodeWrapper(spec, 32, max_seq_len=256, target="interpret")
    indptr, indices = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([2, 0, 3], dtype=torch.int32)
    w.plan(indptr, indices, None, num_pages=4, seq_lens=[20, 64])
    pools = {n: foldc.quantize(torch.randn(4, 2, 32, 64, generator=gen), getattr(spec, n)) for n in "kv"}
    q = torch.randn(2, 4, 64, generator=gen).half()
    got = w.run(q, pools["k"], pools["v"], seq_lens=torch.tensor([20, 250], dtype=torch.int32))
    k, _ = gather_pages(pools["k"], indptr, indices, [20, 64], 32)
    v, _ = gather_pages(pools["v"], indptr, indices, [20, 64], 32)
    want = foldc.attention_reference(q, k, v, seq_lens=torch.tensor([20, 64]))
    assert rel_l2(got, want) < TOL


@pytest.mark.parametrize("kv", [(A(4, "token", 32), A(4, "token", 32)), (A(4, "token", 64), A(2, "token", 64)),
                                (A(2, "token", 16), A(8, "token", 64, torch.float32))],
                         ids=["one-encoding", "4-and-2-bits", "other-groups-and-scales"])
def test_a_decode_steps_pair_launch_binds_and_then_launches_by_address(monkeypatch, kv):
    """Natively (stand-in kernels on the CPU), straight to pages with K and V token-wise (one encoding or one each):
    the first two decode steps' pair launches are keyed, the second binds, later steps give the bound launch the
    tokens', the layer's pools', its offsets', the page table's and its counters' addresses, one bound launch for
    every layer; a bound launch that declines takes the keyed way."""
    from foldc.serving import append as append_module
    from test_cache import _KernelStandIn

    kernels = {}
    monkeypatch.setattr(append_module, "_fast", lambda name, interpret: kernels.setdefault(name, _KernelStandIn()))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = PagedKVCache(S(4, 2, 64, *kv), num_layers=2, page_size=16, num_pages=16, max_seq_len=64)
    cache._append_interpret = False   # as on a GPU, with the launches recorded instead of run
    cache.plan(*_table(2, 3, 16, seed=5), seq_lens=[0, 0])
    gen = torch.Generator().manual_seed(13)
    for layer in range(2):
        cache.append(layer, *_tokens(gen, 2, 2, 5, 64))
    kernel = kernels["token"]
    prefill = len(kernel.launches)
    steps = []
    for step in range(4):
        for layer in range(2):
            k, v = _tokens(gen, 2, 2, 1, 64)
            v = v.transpose(1, 2).contiguous().transpose(1, 2)   # the value as transformers makes it
            cache.append(layer, k, v)
            steps.append((layer, k, v))
    assert len(kernel.launches) == prefill + 2 and len(kernel.binds) == 1   # layer 0 and 1 of step 0 keyed
    (bound,), = cache._append_bindings.bound()
    assert len(bound.calls) == 6
    for (layer, k, v), (addresses, values) in zip(steps[2:], bound.calls):
        kp, vp = cache.pools[layer]["k"], cache.pools[layer]["v"]
        st = cache._layers[layer]
        codes = kp.codes.data_ptr()
        assert addresses == (k.data_ptr(), codes, kp.scale.data_ptr(), kp.zero.data_ptr(), st["body"].data_ptr(),
                             cache.wrapper.kv_indptr.data_ptr(), cache.wrapper.kv_indices.data_ptr(), codes, codes,
                             v.data_ptr(), vp.codes.data_ptr(), vp.scale.data_ptr(), vp.zero.data_ptr(),
                             st["arrivals"].data_ptr())   # the launch moves the offsets on itself
        assert values == ()
    keyed = kernel.launches[prefill]
    assert keyed[0].data_ptr() == steps[0][1].data_ptr() and keyed[4] is cache._layers[0]["body"]
    vp = cache.pools[0]["v"]
    assert keyed[9].data_ptr() == steps[0][2].data_ptr() and keyed[-12:] == (
        *steps[0][2].stride()[:3], *vp.codes.stride()[:3], *vp.scale.stride()[:3], *vp.zero.stride()[:3])
    monkeypatch.setattr(type(bound), "__call__", lambda self, addresses, values=(): False)   # it declines
    cache.append(0, *_tokens(gen, 2, 2, 1, 64))
    assert len(kernel.launches) == prefill + 3
    assert cache.num_tokens(0) == [10, 10] and cache.num_tokens(1) == [9, 9]


@pytest.mark.parametrize("kv", [(A(4, "token", 32), A(4, "token", 32)), (A(4, "token", 64), A(2, "token", 64))],
                         ids=["one-encoding", "two-encodings"])
def test_a_decode_step_shaped_as_the_last_bound_one_skips_the_whole_path(monkeypatch, kv):
    """Straight to pages, natively (stand-in kernels): once a layer's pair write went bound (K and V of one
    encoding or one each), its next steps of the same shapes, strides and dtypes go from a few comparisons to the
    bound launch (no `_state`, no token checks, capacity by the layer's room) and the host counts still advance; a
    layer that is not an int, a step past capacity and the first step after `plan` take the whole path, which
    refuses by name or binds again."""
    from foldc.serving import append as append_module
    from test_cache import _KernelStandIn

    kernels = {}
    monkeypatch.setattr(append_module, "_fast", lambda name, interpret: kernels.setdefault(name, _KernelStandIn()))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = PagedKVCache(S(4, 2, 64, *kv), num_layers=2, page_size=16, num_pages=16, max_seq_len=24)
    cache._append_interpret = False
    table = _table(2, 2, 16, seed=6)   # two pages a sequence: 24 tokens at most
    cache.plan(*table, seq_lens=[0, 0])
    gen = torch.Generator().manual_seed(14)
    for layer in range(2):
        cache.append(layer, *_tokens(gen, 2, 2, 5, 64))
        for _ in range(3):   # keyed, keyed (binds), bound: the layer's fast-path entry
            cache.append(layer, *_tokens(gen, 2, 2, 1, 64))
    whole = []
    real_state = cache._state
    monkeypatch.setattr(cache, "_state", lambda layer: whole.append(layer) or real_state(layer))
    (bound,), = cache._append_bindings.bound()
    calls = len(bound.calls)
    for step in range(3):
        for layer in range(2):
            cache.append(layer, *_tokens(gen, 2, 2, 1, 64))
    assert whole == [] and len(bound.calls) == calls + 6
    assert cache.num_tokens(0) == [11, 11] and cache.num_tokens(1) == [11, 11]
    with pytest.raises(InputError, match="layer=True"):
        cache.append(True, *_tokens(gen, 2, 2, 1, 64))
    assert whole == [0, 1, True]   # (num_tokens reads through _state too)
    cache.plan(*table, seq_lens=[11, 11])   # a new plan: its addresses are made again
    assert cache._token_write is None and cache._write_fixed == {}
    whole.clear()
    for _ in range(13):
        cache.append(0, *_tokens(gen, 2, 2, 1, 64))
    assert whole == [0] and cache.num_tokens(0) == [24, 24]   # the whole path once, then fast to capacity
    with pytest.raises(InputError, match="past capacity"):
        cache.append(0, *_tokens(gen, 2, 2, 1, 64))
    assert cache.num_tokens(0) == [24, 24]


def test_attention_shaped_as_the_last_whole_path_call_goes_straight_to_the_prepared_run(monkeypatch):
    """Straight to pages, on the register-operand launcher (stand-in launches on the CPU, real appends in the
    interpreter): once the whole path ran a layer's attention, calls of the same q shape, strides, dtype, device and
    sm_scale argument go from a few comparisons to the wrapper's prepared run over that layer's pools and offsets
    (no `_state`, no checks; the bound decode is given the layer's offsets, which its appends move on); another
    dtype, scale, a strided q, a layer that is not an int and the first call after `plan` take the whole path."""
    from _stand_in_wrapper import stand_in_register_operand

    enc = A(4, "token", 64)
    spec = S(8, 2, 128, enc, enc)
    cache = PagedKVCache(spec, num_layers=2, page_size=64, num_pages=8, max_seq_len=256, target="interpret")
    decode, merge = stand_in_register_operand(cache.wrapper, spec, monkeypatch)
    table = _table(2, 4, 8, seed=3)
    cache.plan(*table, seq_lens=[0, 0])
    gen = torch.Generator().manual_seed(21)
    for layer in range(2):
        cache.append(layer, *_tokens(gen, 2, 2, 9, 128))
    q = torch.randn(2, 8, 128, generator=gen).half()
    for _ in range(2):   # the whole path: the second run binds the launches
        for layer in range(2):
            cache.attention(layer, q)
    whole = []
    real_state = cache._state
    monkeypatch.setattr(cache, "_state", lambda layer: whole.append(layer) or real_state(layer))
    calls = len(decode.bound[0].calls)
    for step in range(3):
        for layer in range(2):
            cache.append(layer, *_tokens(gen, 2, 2, 1, 128))
            out = cache.attention(layer, q)
            assert out.shape == q.shape and out.dtype == q.dtype
            body = cache._layers[layer]["body"]
            assert decode.bound[0].calls[-1][7] == body.data_ptr()   # the layer's own offsets
            assert decode.bound[0].calls[-1][1] == cache.pools[layer]["k"].codes.data_ptr()
    assert whole == [0, 1] * 3   # the appends' whole path (the interpreter's) only: no attention's
    assert len(decode.bound[0].calls) == calls + 6
    assert cache._layers[1]["body"].tolist() == [12, 12]
    for call in (lambda: cache.attention(0, q, sm_scale=0.1),
                 lambda: cache.attention(0, torch.randn(2, 8, 256, generator=gen).half()[..., :128])):   # strided
        whole.clear()
        call()
        assert whole == [0]
    scale = torch.tensor(0.125)   # a tensor scale may change in place: read by the whole path every call
    for value in (0.125, 0.5):
        scale.fill_(value)
        whole.clear()
        cache.attention(0, q, sm_scale=scale)
        assert whole == [0] and not isinstance(cache._attend[4], torch.Tensor)   # (still the float scale's key)
    cache.attention(0, q)   # bound again
    whole.clear()
    with pytest.raises(InputError, match="q is torch.bfloat16"):   # refused by the whole path, by name
        cache.attention(0, q.bfloat16())
    assert whole == [0]
    with pytest.raises(InputError, match="layer=True"):
        cache.attention(True, q)
    cache.plan(*table, seq_lens=[12, 12])   # a new plan: the whole path once, then the fast path again
    assert cache._attend is None and cache._attend_runs == {}
    whole.clear()
    cache.attention(0, q)
    cache.attention(0, q)
    assert whole == [0]


def test_a_query_that_records_gradients_gets_an_output_whose_backward_raises(monkeypatch):
    """The cache's kernels have no backward: their output had no grad_fn, so a loss through the cache's attention
    trained the rest of a model and never q, silently. Now its backward raises by name on each path (body and
    window merged; straight to pages; the prepared run of a call shaped as the last one), values unchanged."""
    from _stand_in_wrapper import stand_in_register_operand

    from foldc.errors import UnsupportedError

    def raises_at_backward(y):
        assert y.requires_grad
        with pytest.raises(UnsupportedError, match=r"^PagedKVCache\.attention has no backward.*target='reference'"):
            y.float().sum().backward()

    gen = torch.Generator().manual_seed(23)
    spec = S(4, 2, 64, A(4, "token", 32), A(4, "token", 32))
    merged = PagedKVCache(spec, num_layers=1, page_size=16, num_pages=12, max_seq_len=64, sink=1, window=4)
    merged.plan(*_table(2, 4, 12, seed=2), seq_lens=[0, 0])
    merged.append(0, *_tokens(gen, 2, 2, 30, 64))
    q = torch.randn(2, 4, 64, generator=gen).half()
    got = merged.attention(0, q.clone().requires_grad_())
    assert torch.equal(got.detach(), merged.attention(0, q))
    raises_at_backward(got)
    with torch.no_grad():
        assert not merged.attention(0, q.clone().requires_grad_()).requires_grad

    enc = A(4, "token", 64)
    direct = PagedKVCache(S(8, 2, 128, enc, enc), num_layers=1, page_size=64, num_pages=8, max_seq_len=256,
                          target="interpret")
    decode, merge = stand_in_register_operand(direct.wrapper, direct.spec, monkeypatch)
    direct.plan(*_table(2, 4, 8, seed=3), seq_lens=[0, 0])
    direct.append(0, *_tokens(gen, 2, 2, 9, 128))
    q = torch.randn(2, 8, 128, generator=gen).half()
    raises_at_backward(direct.attention(0, q.clone().requires_grad_()))   # the whole path
    direct.attention(0, q)
    assert direct._attend is not None   # bound: the next call is the prepared run's
    whole, real_state = [], direct._state
    monkeypatch.setattr(direct, "_state", lambda layer: whole.append(layer) or real_state(layer))
    raises_at_backward(direct.attention(0, q.clone().requires_grad_()))
    assert whole == [] and not direct.attention(0, q).requires_grad


@pytest.mark.parametrize("spec, sink, window", [(S(4, 2, 64, A(2, "token", 32), A(4, "channel", 16)), 2, 5),
                                                (S(4, 2, 64, A(2, "token", 32), A(4, "token", 64)), 0, 0)],
                         ids=["sink-window", "straight-to-pages"])
def test_a_deepcopy_holds_the_same_tokens_in_pools_of_its_own(spec, sink, window):
    """transformers reuses a prompt's cache by ``copy.deepcopy`` (a PagedFoldcCache holds this cache): Python's copy
    raised TypeError ("cannot pickle 'module' object") from inside the copy. The copy holds the original's tokens
    under the same page table; each then takes appends of its own without touching the other, each equal to a fresh
    cache given the same appends."""
    gen = torch.Generator().manual_seed(21)
    table = _table(2, 3, 8, seed=4)

    def make():
        c = PagedKVCache(spec, num_layers=2, page_size=32, num_pages=8, max_seq_len=96, sink=sink, window=window,
                         target="interpret")
        c.plan(*table, seq_lens=[0, 0])
        return c

    def append(c, steps):
        for k, v in steps:
            for layer in range(2):
                c.append(layer, k, v)

    prompt = [_tokens(gen, 2, 2, 19, 64), *(_tokens(gen, 2, 2, 1, 64) for _ in range(3))]
    q = torch.randn(2, 4, 64, generator=gen).half()
    cache = make()
    append(cache, prompt)
    cache.attention(1, q)
    twin = copy.deepcopy(cache)
    assert twin.num_tokens(1) == cache.num_tokens(1) and twin.pools[0]["k"].codes is not cache.pools[0]["k"].codes
    for c in (twin, cache):   # the copy first: the original must not see its tokens
        rest = [_tokens(gen, 2, 2, 7, 64), *(_tokens(gen, 2, 2, 1, 64) for _ in range(3))]
        fresh = make()
        append(fresh, prompt + rest)
        append(c, rest)
        for layer in range(2):
            for got, want in zip(c.dequantized(layer), fresh.dequantized(layer)):
                assert got == want if isinstance(got, list) else torch.equal(got, want)
            assert torch.equal(c.attention(layer, q), fresh.attention(layer, q))


@pytest.mark.parametrize("target", ["interpret", "reference"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_sparse_tokens_and_queries_are_refused_by_name_and_change_nothing(target, tokens):
    """Sparse keys, values or queries raised NotImplementedError or RuntimeError from inside torch (its amax, scatter
    or data_ptr); each is an `InputError` naming the layout now, and the cache holds and attends as before."""
    gen = torch.Generator().manual_seed(17 + tokens)
    cache = PagedKVCache(S(4, 2, 64, A(4, "token", 32), A(4, "channel", 16)), num_layers=1, page_size=16,
                         num_pages=8, max_seq_len=48, sink=1, window=2, target=target)
    cache.plan(torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([5, 0, 7, 2, 6, 1], dtype=torch.int32),
               seq_lens=[0, 0])
    k, v = _tokens(gen, 2, 2, 21, 64)
    cache.append(0, k, v)
    before = cache.dequantized(0)
    k, v = _tokens(gen, 2, 2, tokens, 64)
    for args in ((k.to_sparse(), v), (k, v.to_sparse())):
        with pytest.raises(InputError, match=r"[kv]_new is a tensor of layout torch\.sparse_coo; .*\.to_dense\(\)"):
            cache.append(0, *args)
    after = cache.dequantized(0)
    assert after[2] == before[2] == [21, 21]
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    q = torch.randn(2, 4, 64, generator=gen).half()
    with pytest.raises(InputError, match=r"q is a tensor of layout torch\.sparse_coo; .* q\.to_dense\(\)"):
        cache.attention(0, q.to_sparse())
    assert rel_l2(cache.attention(0, q), foldc.attention_reference(q, after[0], after[1])) < TOL
