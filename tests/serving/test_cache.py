"""QuantizedKVCache: every token lands in the right part exactly once, the body holds exactly
foldc.quantize of its tokens (grouped from the body's start), and attention over the cache equals
float64 attention over its dequantized contents."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import InputError, InputTypeError, SpecError
from foldc.serving import QuantizedKVCache

A = foldc.Affine
# layouts the Triton backend can tile (chunks of >= 16 channels, token groups of 16k)
SPECS = {
    "K token2 / V channel4": foldc.AttentionSpec(4, 2, 64, A(2, "token", 16), A(4, "channel", 16)),
    "K channel2 / V token2": foldc.AttentionSpec(4, 2, 64, A(2, "channel", 32), A(2, "token", 32)),
    "K channel4 g32 / V channel2 g48": foldc.AttentionSpec(2, 2, 64, A(4, "channel", 32), A(2, "channel", 48)),
    "K token8 bf16 scales / V plain": foldc.AttentionSpec(4, 1, 64, A(8, "token", 64, torch.bfloat16), None),
    # two token-wise encodings: the body's writes are the append kernel's pair launches
    "K token4 / V token2 g32 bf16 scales": foldc.AttentionSpec(4, 2, 64, A(4, "token", 64),
                                                               A(2, "token", 32, torch.bfloat16)),
    "plain / plain": foldc.AttentionSpec(4, 2, 64),
    # head_dim 96 (Phi-3's): 24-channel bit fields at INT2, padded by the append and attention kernels
    "K token2 / V channel2 d96": foldc.AttentionSpec(4, 2, 96, A(2, "token", 96), A(2, "channel", 16)),
}
TOL = 2e-3  # relative: fp16 attention against float64 on the same values


def rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


class Tracker:
    """The tokens appended so far, and what the cache must hold for them."""

    def __init__(self, cache: QuantizedKVCache):
        self.cache, self.k, self.v = cache, [], []

    def append(self, k, v):
        self.cache.append(k, v)
        self.k.append(k)
        self.v.append(v)

    def check(self):
        c, spec = self.cache, self.cache.spec
        keys, vals = torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)
        n = keys.shape[2]
        # where each token must be: sink first, then whole flush units into the body
        sink = min(n, c.sink)
        body = max(0, n - c.sink - c.window) // c.unit * c.unit if n > c.sink else 0
        assert (c.num_tokens, c.sink_tokens, c.body_tokens, c.window_tokens) == (n, sink, body, n - sink - body)
        assert c.window_tokens <= c.window + c.unit - 1
        got_k, got_v = c.dequantized()
        for name, x, got, part in (("k", keys, got_k, c.body()[0]), ("v", vals, got_v, c.body()[1])):
            enc = getattr(spec, name)
            body_x = x[:, :, sink:sink + body]
            if body and enc is not None:
                want_q = foldc.quantize(body_x, enc)
                for field in ("codes", "scale", "zero"):
                    assert torch.equal(getattr(part, field), getattr(want_q, field)), f"{name} body {field}"
                body_f = want_q.dequantize()
            else:
                body_f = body_x.float()
            want = torch.cat([x[:, :, :sink].float(), body_f, x[:, :, sink + body:].float()], dim=2)
            assert got.dtype == torch.float32 and torch.equal(got, want), f"{name}: dequantized() differs"
        return got_k, got_v

    def check_attention(self, gen):
        got_k, got_v = self.check()
        c = self.cache
        q = torch.randn(c.batch, c.spec.num_q_heads, c.spec.head_dim, generator=gen).half()
        sm_scale = float(0.5 + torch.rand((), generator=gen)) / math.sqrt(c.spec.head_dim)
        out, lse = c.attention(q, sm_scale=sm_scale, return_lse=True)
        ref = foldc.attention_reference(q, got_k, got_v, sm_scale=sm_scale)
        assert out.dtype == torch.float16 and out.shape == ref.shape
        assert rel_err(out, ref) < TOL, f"attention error {rel_err(out, ref):.2e} ({c!r})"
        logits = torch.einsum("bkhd,bknd->bkhn", q.double().reshape(c.batch, c.spec.num_kv_heads, -1, c.spec.head_dim),
                              got_k.double()) * sm_scale
        # lse carries the kernel's fp16 logit rounding (q x s is rounded once under channel-wise K
        # folds): worst seen 2.2e-3 with offset keys
        assert torch.allclose(lse.double(), torch.logsumexp(logits, -1).reshape(lse.shape), atol=5e-3)


def _tokens(cache, n, gen, shift=0.0):
    shape = (cache.batch, cache.spec.num_kv_heads, n, cache.spec.head_dim)
    return (torch.randn(shape, generator=gen) + shift).half(), (torch.randn(shape, generator=gen) * 2 + 1).half()


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(SPECS)), sink=st.sampled_from([0, 1, 4]), window=st.sampled_from([0, 1, 7, 20]),
       prefill=st.integers(1, 70), steps=st.lists(st.one_of(st.just(1), st.integers(1, 40)), min_size=0, max_size=10),
       batch=st.integers(1, 2), seed=st.integers(0, 2**31 - 1))
@example(name="K token2 / V channel2 d96", sink=1, window=7, prefill=40, steps=[1, 17, 1], batch=2, seed=5)
@example(name="K token4 / V token2 g32 bf16 scales", sink=0, window=0, prefill=9, steps=[1, 1, 5, 1], batch=2, seed=3)
@example(name="K token4 / V token2 g32 bf16 scales", sink=2, window=3, prefill=4, steps=[1, 1, 1, 6, 1], batch=1,
         seed=4)
def test_any_sequence_of_appends_is_cached_exactly(name, sink, window, prefill, steps, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    total = prefill + sum(steps)
    cache = QuantizedKVCache(SPECS[name], batch, total + int(torch.randint(0, 5, (), generator=gen)), sink=sink,
                             window=window, target="interpret")
    track = Tracker(cache)
    track.append(*_tokens(cache, prefill, gen, shift=3.0))
    track.check_attention(gen)
    for i, n in enumerate(steps):
        track.append(*_tokens(cache, n, gen))
        track.check()
    if steps:
        track.check_attention(gen)


def test_decode_steps_cross_every_boundary():
    """Sink filling, window filling, token-wise flushes every step and a channel-wise group flush,
    one token at a time."""
    gen = torch.Generator().manual_seed(7)
    cache = QuantizedKVCache(SPECS["K token2 / V channel4"], 2, 60, sink=3, window=5, target="interpret")
    track = Tracker(cache)
    seen = set()
    for _ in range(41):
        track.append(*_tokens(cache, 1, gen))
        track.check()
        seen.add((cache.sink_tokens, cache.body_tokens > 0))
    assert cache.body_tokens == 32 and cache.window_tokens == 6
    assert seen == {(1, False), (2, False), (3, False), (3, True)}
    track.check_attention(gen)


def test_a_token_wise_window_is_a_ring_whose_slots_are_never_moved():
    """Without channel-wise groups the window is a ring: each step's oldest token leaves for the body and the
    new one takes its slot, so the slots rotate; every step (and a multi-token append that wraps) still
    caches exactly the tokens in order, and attention reads the ring as it lies."""
    gen = torch.Generator().manual_seed(12)
    spec = foldc.AttentionSpec(4, 2, 64, A(2, "token", 16), A(4, "token", 32))
    cache = QuantizedKVCache(spec, 2, 80, sink=2, window=7, target="interpret")
    assert cache._ring
    track = Tracker(cache)
    track.append(*_tokens(cache, 5, gen))
    heads, total = set(), 5
    for n in [1] * 12 + [10, 3, 1, 1, 9]:
        track.append(*_tokens(cache, n, gen))
        total += n
        track.check()
        heads.add(cache._ring_head)
        assert cache.window_tokens == min(7, total - 2)
    assert len(heads) > 3   # the ring turned
    ring_slots = cache._plain["k"][:, :, 2:9].clone()
    track.append(*_tokens(cache, 1, gen))
    moved = (cache._plain["k"][:, :, 2:9] != ring_slots).any(dim=(0, 1, 3))
    assert int(moved.sum()) == 1   # one slot took the new token; the six kept ones stayed where they were
    track.check_attention(gen)


def test_a_prompt_shorter_than_a_group_stays_plain_until_the_group_fills():
    gen = torch.Generator().manual_seed(8)
    cache = QuantizedKVCache(SPECS["K channel2 / V token2"], 1, 100, target="interpret")  # channel groups of 32
    track = Tracker(cache)
    track.append(*_tokens(cache, 20, gen))
    assert (cache.body_tokens, cache.window_tokens) == (0, 20)
    track.check_attention(gen)
    track.append(*_tokens(cache, 12, gen))
    assert (cache.body_tokens, cache.window_tokens) == (32, 0)
    track.check_attention(gen)


def test_channel_groups_of_k_and_v_flush_together():
    # K groups of 32, V groups of 48: both bodies must hold whole groups, so flushes come in 96s
    cache = QuantizedKVCache(SPECS["K channel4 g32 / V channel2 g48"], 1, 250, window=2, target="interpret")
    assert cache.unit == 96
    track = Tracker(cache)
    gen = torch.Generator().manual_seed(9)
    track.append(*_tokens(cache, 150, gen))
    assert (cache.body_tokens, cache.window_tokens) == (96, 54)
    track.check_attention(gen)
    track.append(*_tokens(cache, 44, gen))
    assert (cache.body_tokens, cache.window_tokens) == (192, 2)
    track.check_attention(gen)


def test_empty_parts_launch_nothing():
    gen = torch.Generator().manual_seed(10)
    calls = []

    class Counting:   # the part's compiled attention, recording each run (the cache plans, then runs)
        def __init__(self, attn, part):
            self.attn, self.part = attn, part

        def plan_launch(self, *args, **kwargs):
            return self.attn.plan_launch(*args, **kwargs)

        def run(self, *args, **kwargs):
            calls.append((self.part, int(kwargs["seq_lens"][0])))
            return self.attn.run(*args, **kwargs)

    def counting(cache, part):
        setattr(cache, part, Counting(getattr(cache, part), part))

    only_body = QuantizedKVCache(SPECS["K token2 / V channel4"], 1, 64, target="interpret")
    only_plain = QuantizedKVCache(SPECS["K token2 / V channel4"], 1, 64, sink=8, target="interpret")
    for cache in (only_body, only_plain):
        counting(cache, "_body_attention")
        counting(cache, "_plain_attention")
        track = Tracker(cache)
        track.append(*_tokens(cache, 16 if cache is only_body else 8, gen))
        track.check_attention(gen)
    assert calls == [("_body_attention", 16), ("_plain_attention", 8)]


def test_reset_forgets_every_token():
    gen = torch.Generator().manual_seed(12)
    cache = QuantizedKVCache(SPECS["K token2 / V channel4"], 2, 64, sink=2, window=3, target="interpret")
    cache.append(*_tokens(cache, 50, gen, shift=5.0))
    cache.reset()
    assert cache.num_tokens == 0
    track = Tracker(cache)
    track.append(*_tokens(cache, 21, gen))
    track.check_attention(gen)


def test_reference_target_with_float32_tokens():
    gen = torch.Generator().manual_seed(13)
    spec = foldc.AttentionSpec(4, 2, 48, A(4, "token", 16), A(4, "channel", 5))  # no Triton tiling needed
    cache = QuantizedKVCache(spec, 2, 40, sink=1, window=2, dtype=torch.float32, target="reference")
    k, v = torch.randn(2, 2, 33, 48, generator=gen), torch.randn(2, 2, 33, 48, generator=gen)
    cache.append(k, v)
    assert (cache.body_tokens, cache.window_tokens) == (30, 2)
    assert torch.equal(cache.body()[1].codes, foldc.quantize(v[:, :, 1:31], spec.v).codes)
    q = torch.randn(2, 4, 48, generator=gen)
    dk, dv = cache.dequantized()
    out = cache.attention(q)
    assert out.dtype == torch.float64
    assert torch.allclose(out, foldc.attention_reference(q, dk, dv), rtol=1e-10, atol=1e-12)


# ---- errors: one per message ------------------------------------------------------------------

SPEC = SPECS["K token2 / V channel4"]


@pytest.fixture(scope="module")
def cache():
    return QuantizedKVCache(SPEC, 2, 40, sink=2, window=4, target="interpret")


@pytest.mark.parametrize("kwargs,match", [
    (dict(spec="token:2:16"), "spec must be a foldc.AttentionSpec, got str"),
    (dict(batch=0), "batch=0 must be a positive integer"),
    (dict(sink=-1), "sink=-1 must be an integer >= 0"),
    (dict(dtype=torch.float64), r"dtype=torch.float64 is not supported; use one of"),
    (dict(device="gpu0"), "device='gpu0' is not a torch device"),
    (dict(target="cuda"), "target='cuda' is not available"),
    (dict(dtype=torch.bfloat16, target="auto"),
     "target='auto' runs Triton's interpreter, float16 on the CPU; got dtype=torch.bfloat16 on cpu"),
    (dict(target="sm_90", dtype=torch.float32), "target='sm_90' attends with float16 or bfloat16 tokens"),
    (dict(spec=foldc.AttentionSpec(4, 2, 64, A(2, "token", 8))), "would cross a group of 8"),
])
def test_bad_construction_names_the_value_and_the_fix(kwargs, match):
    args = dict(spec=SPEC, batch=1, capacity=16, target="interpret")
    args.update(kwargs)
    with pytest.raises(SpecError, match=match):
        QuantizedKVCache(args.pop("spec"), args.pop("batch"), args.pop("capacity"), **args)


def _kv(n=3, batch=2, heads=2, d=64, dtype=torch.float16):
    return torch.randn(batch, heads, n, d).to(dtype), torch.randn(batch, heads, n, d).to(dtype)


@pytest.mark.parametrize("args,exc,match", [
    (lambda: (_kv()[0].tolist(), _kv()[1]), InputTypeError, "k_new must be a torch.Tensor"),
    (lambda: (_kv()[0], _kv(heads=1)[1]), InputError,
     r"v_new shape=\(2, 1, 3, 64\) but this cache holds \[2, 2, tokens, 64\]"),
    (lambda: _kv(dtype=torch.float32), InputError,
     r"k_new dtype=torch.float32 but the cache was built with dtype=torch.float16; pass k_new.to"),
    (lambda: (_kv()[0].to("meta"), _kv()[1]), InputError, "k_new is on meta but the cache is on cpu"),
    (lambda: (_kv(3)[0], _kv(4)[1]), InputError, "k_new holds 3 tokens but v_new holds 4"),
    (lambda: _kv(41), InputError, "appending 41 tokens to 0 would hold 41 but capacity=40"),
])
def test_bad_appends_name_the_value_and_the_fix(cache, args, exc, match):
    with pytest.raises(exc, match=match):
        cache.append(*args())
    assert cache.num_tokens == 0


def test_a_rejected_append_leaves_the_cache_as_it_was():
    gen = torch.Generator().manual_seed(14)
    cache = QuantizedKVCache(SPEC, 2, 60, sink=2, window=4, target="interpret")
    track = Tracker(cache)
    track.append(*_tokens(cache, 30, gen))
    k, v = _tokens(cache, 20, gen)
    v[1, 0, 17, 3] = float("nan")
    with pytest.raises(InputError, match=r"v_new holds NaN or Inf \(first at index \[1, 0, 17, 3\]\)"):
        cache.append(k, v)
    k2, v2 = _tokens(cache, 40, gen)
    with pytest.raises(InputError, match="appending 40 tokens to 30 would hold 70 but capacity=60"):
        cache.append(k2, v2)
    track.check_attention(gen)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("kv,window,steps", [(("token:2:32", "token:4:16"), 0, 0), (("token:2:32", "token:4:16"), 3, 3),
                                              (("channel:2:16", "token:2:32"), 0, 7)])
def test_a_one_token_append_of_nan_or_inf_is_reported_by_the_next_call(kv, window, steps, bad):
    """One-token appends read nothing back from the device: the append kernel that quantizes a token into the
    body flags a scale or zero that is not finite, and from then on every append and attention raises, and
    check() does, until reset(). A token kept plain (the window, a channel-wise group still filling) is
    flagged when it moves to the body."""
    from foldc.encoding import parse_affine

    spec = foldc.AttentionSpec(4, 2, 32, *(parse_affine(t) for t in kv))
    gen = torch.Generator().manual_seed(31)
    cache = QuantizedKVCache(spec, 2, 48, window=window, target="interpret")
    cache.append(*_tokens(cache, 8, gen))
    k, v = _tokens(cache, 1, gen)
    (k if window else v)[1, 0, 0, 7] = bad
    cache.append(k, v)                     # no sync: the cache's next call raises
    taken = 0   # one-token steps until the token reaches the body: the window's, or the group's rest (9th of 16)
    while taken <= 20:
        try:
            cache.check()
        except InputError:
            break
        cache.append(*_tokens(cache, 1, gen))
        taken += 1
    assert taken == steps
    q = torch.randn(2, 4, 32, generator=gen).half()
    for call in (cache.check, lambda: cache.attention(q), lambda: cache.append(*_tokens(cache, 1, gen))):
        with pytest.raises(InputError, match="a one-token append held NaN or Inf, or a value whose scale or zero "
                                             "overflows"):
            call()
    cache.reset()
    cache.append(*_tokens(cache, 3, gen))
    cache.append(*_tokens(cache, 1, gen))
    assert torch.isfinite(cache.attention(q)).all()


@settings(max_examples=12, deadline=None)
@given(kv=st.sampled_from([("token:2:32", "token:4:16"), ("channel:2:16", "token:2:32"),
                            ("token:4:32", "channel:4:16")]),
       window=st.integers(0, 3), decode=st.integers(1, 4), bad_at=st.integers(0, 3),
       bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]), seed=st.integers(0, 2**31 - 1))
@example(kv=("token:2:32", "token:4:16"), window=2, decode=1, bad_at=0, bad=float("nan"), seed=1)
@example(kv=("channel:2:16", "token:2:32"), window=2, decode=3, bad_at=2, bad=float("inf"), seed=2)
def test_a_bad_token_kept_plain_is_reported_when_an_append_of_several_tokens_moves_it(kv, window, decode, bad_at,
                                                                                       bad, seed):
    """A one-token append is checked by the flag of the kernel that quantizes it; a token the window (or a filling
    channel-wise group) keeps plain is quantized later. When an append of several tokens (a chunked prompt after
    decode steps) moves it to the body, that append raises before writing, and so does every call until reset()
    (before: NaN scales written without a word, check() passed and attention was NaN from then on)."""
    from foldc.encoding import parse_affine

    spec = foldc.AttentionSpec(4, 2, 32, *(parse_affine(t) for t in kv))
    gen = torch.Generator().manual_seed(seed)
    cache = QuantizedKVCache(spec, 2, 80, window=window, target="interpret")
    cache.append(*_tokens(cache, int(torch.randint(2, 20, (), generator=gen)), gen))
    bad_at = min(bad_at, decode - 1)
    for step in range(decode):
        k, v = _tokens(cache, 1, gen)
        if step == bad_at:
            row, head, channel = (int(torch.randint(0, n, (), generator=gen)) for n in (2, 2, 32))
            (k if seed % 2 else v)[row, head, 0, channel] = bad
        try:
            cache.append(k, v)
        except InputError:   # flagged by the kernel that quantized it, at a later one-token append
            break
    counts = (cache.num_tokens, cache.body_tokens, cache.window_tokens)
    chunk = _tokens(cache, window + cache.unit, gen)   # moves every token the window holds to the body
    with pytest.raises(InputError, match="a one-token append held NaN or Inf"):
        cache.append(*chunk)
    assert (cache.num_tokens, cache.body_tokens, cache.window_tokens) == counts
    q = torch.randn(2, 4, 32, generator=gen).half()
    for call in (cache.check, lambda: cache.attention(q), lambda: cache.append(*_tokens(cache, 3, gen))):
        with pytest.raises(InputError, match="a one-token append held NaN or Inf"):
            call()
    cache.reset()
    cache.append(*_tokens(cache, 4, gen))
    assert torch.isfinite(cache.attention(q)).all()


def test_the_check_of_tokens_kept_plain_ends_once_an_append_has_moved_them_all():
    """The check of tokens one-token appends kept plain costs a sync per append of several tokens; once one append
    has moved every such token to the body (as many tokens as the window and a group hold), later ones skip it."""
    spec = foldc.AttentionSpec(4, 2, 32, foldc.Affine(2, "token", 32), foldc.Affine(4, "channel", 16))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    cache = QuantizedKVCache(spec, 2, 120, window=3, target="interpret")
    cache.append(*_tokens(cache, 20, gen))
    for _ in range(2):
        cache.append(*_tokens(cache, 1, gen))
    assert cache._plain_unchecked
    cache.append(*_tokens(cache, 2, gen))   # fewer than the window: older plain tokens stay unchecked
    assert cache._plain_unchecked
    cache.append(*_tokens(cache, cache.window + cache.unit, gen))
    assert not cache._plain_unchecked
    q = torch.randn(2, 4, 32, generator=gen).half()
    assert torch.isfinite(cache.attention(q)).all()


def test_a_one_token_append_into_the_sink_is_checked_at_once():
    """A sink token is never quantized (no kernel could flag it): one-token appends that fill the sink keep
    the check before the write, naming the index, and leave the cache as it was."""
    gen = torch.Generator().manual_seed(32)
    cache = QuantizedKVCache(foldc.AttentionSpec(4, 2, 32, A(2, "token", 32), A(2, "token", 32)), 1, 16, sink=2,
                             target="interpret")
    cache.append(*_tokens(cache, 1, gen))
    k, v = _tokens(cache, 1, gen)
    k[0, 1, 0, 5] = float("nan")
    with pytest.raises(InputError, match=r"k_new holds NaN or Inf \(first at index \[0, 1, 0, 5\]\)"):
        cache.append(k, v)
    assert cache.num_tokens == 1 and cache.sink_tokens == 1


def test_scale_overflow_at_flush_is_rejected_without_changing_the_cache():
    gen = torch.Generator().manual_seed(15)
    spec = foldc.AttentionSpec(2, 1, 16, A(4, "token", 16), None)
    cache = QuantizedKVCache(spec, 1, 20, dtype=torch.float32, target="reference")
    k, v = torch.randn(1, 1, 4, 16, generator=gen), torch.randn(1, 1, 4, 16, generator=gen)
    k[0, 0, 2, 0] = -1e6  # zero = min overflows float16 scales
    with pytest.raises(InputError, match="scale or zero overflow scale_dtype=torch.float16"):
        cache.append(k, v)
    assert cache.num_tokens == 0


@pytest.mark.parametrize("q,exc,match", [
    (lambda: [[0.0]], InputTypeError, "q must be a torch.Tensor"),
    (lambda: torch.randn(2, 2, 64).half(), InputError, r"q shape=\(2, 2, 64\) but this cache needs \(2, 4, 64\)"),
    (lambda: torch.randn(2, 4, 64), InputError, "q dtype=torch.float32 but the cache holds torch.float16"),
    (lambda: torch.randn(2, 4, 64).half().to("meta"), InputError, "q is on meta but the cache is on cpu"),
    (lambda: torch.randn(2, 4, 64).half(), InputError, "the cache holds no tokens; append"),
])
def test_bad_attention_calls_name_the_value_and_the_fix(cache, q, exc, match):
    with pytest.raises(exc, match=match):
        cache.attention(q())


def test_layers_of_one_spec_share_one_compiled_attention_and_each_keeps_its_own_tokens():
    """A model's caches (one per layer, one spec) compile the attention once; sharing it must not mix
    their tokens: each layer's attention is the float64 reference over its own tokens."""
    spec = foldc.AttentionSpec(4, 2, 32, A(4, "token", 32), A(4, "token", 32))
    a, b = (QuantizedKVCache(spec, 1, 64, target="reference", dtype=torch.float32) for _ in range(2))
    other = QuantizedKVCache(foldc.AttentionSpec(4, 2, 32), 1, 64, target="reference", dtype=torch.float32)
    assert a._body_attention is b._body_attention and a._plain_attention is b._plain_attention
    assert other._body_attention is not a._body_attention
    gen = torch.Generator().manual_seed(5)
    kvs = [[torch.randn(1, 2, 40, 32, generator=gen) for _ in range(2)] for _ in range(2)]
    q = torch.randn(1, 4, 32, generator=gen)
    for cache, (k, v) in zip((a, b), kvs):
        cache.append(k, v)
    outs = [cache.attention(q) for cache in (a, b)]
    for cache, out in zip((a, b), outs):
        want = foldc.compile(foldc.AttentionSpec(4, 2, 32), "reference")(q, *cache.dequantized())
        assert torch.allclose(out.double(), want.double(), atol=1e-6)
    assert not torch.allclose(outs[0], outs[1])


class _BoundStandIn:
    def __init__(self):
        self.calls = []

    def __call__(self, addresses, values=()):
        self.calls.append((tuple(addresses), tuple(values)))
        return True


class _KernelStandIn:
    """Stands in for the append kernel's `FastLaunch`: records ordinary launches and binds."""

    def __init__(self):
        self.launches, self.binds = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(args)

    def bind(self, grid, args, kwargs, dynamic=()):
        self.binds.append((args, dynamic))
        return _BoundStandIn()


def test_body_writes_bind_their_launch_and_pass_the_offset_per_call(monkeypatch):
    """A GPU cache's one-token body writes: the first launch of a (operand, tokens, strides) is keyed, the
    second binds with the token offset given per call (do_not_specialize), later ones launch the bound
    kernel with the tensors' addresses and that step's offset. Keys of a token-wise encoding beside plain values
    (a launch of their own: no pair). Stand-in kernels; the GPU twin is tests/serving/test_paged_gpu.py."""
    from foldc.serving import append as append_module

    kernels = {}
    monkeypatch.setattr(append_module, "_fast", lambda name, interpret: kernels.setdefault(name, _KernelStandIn()))
    spec = foldc.AttentionSpec(4, 2, 64, A(2, "token", 16), None)   # a body write every token
    cache = QuantizedKVCache(spec, 2, 16, target="interpret")
    assert not cache._pair
    cache._append_mode = "native"     # as on a GPU, with the launches recorded instead of run
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        cache.append(*_tokens(cache, 1, gen))
    assert set(kernels) == {"token"}
    kernel = kernels["token"]
    assert [args[append_module.OFFSET_ARG] for args in kernel.launches] == [0, 1]   # the keys, steps 0 and 1
    assert len(kernel.binds) == 1 and all(dyn == (append_module.OFFSET_ARG,) for _, dyn in kernel.binds)
    (b,), = cache._append_bindings.bound()
    body = cache._body["k"]
    codes = body.codes.data_ptr()
    assert [values for _, values in b.calls] == [(2,), (3,), (4,)]
    assert all(addresses[1:] == (codes, body.scale.data_ptr(), body.zero.data_ptr(), codes, codes, codes, codes,
                                 cache._flag.data_ptr(),   # one-token appends: the kernel's NaN/Inf flag
                                 codes, codes, codes, codes,   # no pair
                                 codes)   # no counters: the offset is the call's
               for addresses, _ in b.calls)
    assert all(args[8] is cache._flag for args in kernel.launches)
    assert cache.body_tokens == 5


@pytest.mark.parametrize("k_enc, v_enc", [(A(4, "token", 32), A(4, "token", 32)),
                                          (A(4, "token", 64), A(2, "token", 64)),
                                          (A(2, "token", 16), A(8, "token", 64, torch.bfloat16))],
                         ids=["one-encoding", "4-and-2-bits", "other-groups-and-scales"])
def test_token_wise_keys_and_values_go_in_one_launch(monkeypatch, k_enc, v_enc):
    """K and V token-wise, of one encoding or one each: each step's body write is one launch of the pair kernel (the
    values' four tensors after the flag, their own strides last, their encoding's constants as the launch's second
    ones, the grid's first axis doubled), bound from the second step like any write; a channel-wise or a plain
    operand keeps a launch each. Stand-in kernels; the bits are the interpreter's (tests/serving/test_append.py)
    and the GPU's (tests/serving/test_paged_gpu.py)."""
    from foldc.serving import append as append_module

    kernels = {}
    monkeypatch.setattr(append_module, "_fast", lambda name, interpret: kernels.setdefault(name, _KernelStandIn()))
    cache = QuantizedKVCache(foldc.AttentionSpec(4, 2, 64, k_enc, v_enc), 2, 16, target="interpret")
    assert cache._pair
    cache._append_mode = "native"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):   # the key as the rotary embedding makes it (contiguous), the value a view of a transpose:
        k, v = _tokens(cache, 1, gen)   # strides that differ along the one token only
        v = torch.empty(v.shape[0], 1, v.shape[1], v.shape[3], dtype=v.dtype).copy_(v.transpose(1, 2)).transpose(1, 2)
        assert k.stride() != v.stride()
        cache.append(k, v)
    kernel = kernels["token"]
    assert len(kernel.launches) == 2 and len(kernel.binds) == 1   # steps 0 and 1 keyed, bound at step 1
    k_body, v_body = cache._body["k"], cache._body["v"]
    for args in kernel.launches:
        assert args[0].shape[2] == 1 and args[1] is k_body.codes
        assert args[10] is v_body.codes and args[11].data_ptr() == v_body.scale.data_ptr()
        assert args[-12:] == (*args[9].stride()[:3], *v_body.codes.stride()[:3], *v_body.scale.stride()[:3],
                              *v_body.zero.stride()[:3])   # the values' own strides
        assert args[9].stride()[:3] != args[0].stride()[:3]
    (bound,), = cache._append_bindings.bound()
    assert [values for _, values in bound.calls] == [(2,), (3,)]
    assert all(addresses[9:] == (addresses[9], v_body.codes.data_ptr(), v_body.scale.data_ptr(),
                                 v_body.zero.data_ptr(), k_body.codes.data_ptr()) and addresses[9] != addresses[0]
               for addresses, _ in bound.calls)
    launch = next(iter(cache._append_launches.values()))
    consts = dict(launch.constants)
    assert launch.grid[0] == 2 * 2 * 2 and consts["PAIR"]   # (k, v) x batch x kv heads
    assert (consts["BITS"], consts["GROUP"], consts["BITS2"], consts["GROUP2"], consts["NUM_GROUPS2"]) == \
        (k_enc.bits, k_enc.group_size, v_enc.bits, v_enc.group_size, 64 // v_enc.group_size)
    assert consts["SCALE_KIND2"] == append_module.SCALE_KIND[v_enc.scale_dtype]
    for k_other, v_other in ((A(4, "token", 32), A(4, "channel", 16)), (A(4, "channel", 16), A(4, "channel", 16)),
                             (A(4, "token", 32), None)):
        other = QuantizedKVCache(foldc.AttentionSpec(4, 2, 64, k_other, v_other), 2, 16, target="interpret")
        assert not other._pair


def test_decode_steps_with_two_token_wise_encodings_write_both_in_one_launch(monkeypatch):
    """K token:4:64 and V token:2:64 (a common recipe), interpreted: every decode step's body write is one pair
    launch (the append kernel planned with the values' encoding), the body holds foldc.quantize's bits of both and
    attention equals float64 attention over the dequantized cache."""
    from foldc.serving import cache as cache_module

    launches = []
    real = cache_module.run_append
    monkeypatch.setattr(cache_module, "run_append",
                        lambda launch, *a, **kw: launches.append((launch, kw.get("second"))) or real(launch, *a, **kw))
    spec = foldc.AttentionSpec(4, 2, 64, A(4, "token", 64), A(2, "token", 64))
    gen = torch.Generator().manual_seed(15)
    cache = QuantizedKVCache(spec, 2, 24, target="interpret")
    track = Tracker(cache)
    track.append(*_tokens(cache, 6, gen, shift=2.0))
    for step in range(5):
        launches.clear()
        track.append(*_tokens(cache, 1, gen))
        (launch, second), = launches
        consts = dict(launch.constants)
        assert second[0] is cache._body["v"] and consts["PAIR"] and consts["BITS"] == 4 and consts["BITS2"] == 2
        if step % 2:
            track.check_attention(gen)
    assert cache.body_tokens == 11


def _stand_in_body(monkeypatch):
    """A one-layer cache (K and V token:4:32, 8/2 heads of 64, target "interpret") whose body attention is the
    register-operand launcher with stand-in launches on the CPU (12 resident programs an SM): (cache, the decode
    launches' recorder)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
    from _kernel_cases import LaunchRecorder

    from foldc.backends.gluon.launch import GluonAttention

    class Resident(GluonAttention):
        def resident(self, *a):
            return 12

    enc = A(4, "token", 32)
    spec = foldc.AttentionSpec(8, 2, 64, enc, enc)
    cache = QuantizedKVCache(spec, 1, 64, target="interpret")
    body = Resident(spec)
    decode, merge = LaunchRecorder(), LaunchRecorder()
    monkeypatch.setattr(body, "_launchers", lambda: (decode, merge))
    cache._body_attention = body
    return cache, decode


def test_decode_steps_run_the_bodys_prepared_attention(monkeypatch):
    """A cache whose body attention plans without lengths (the register-operand kernel, stand-in launches on the
    CPU): every step runs one prepared run per (query dtype, softmax scale), bound from its third call, the
    body's token count given per call; a call that returns the lse takes the plain run with fresh buffers."""
    cache, decode = _stand_in_body(monkeypatch)
    gen = torch.Generator().manual_seed(8)
    cache.append(*_tokens(cache, 10, gen))
    q = torch.randn(1, 8, 64, generator=gen).half()
    for _ in range(5):
        cache.append(*_tokens(cache, 1, gen))
        cache.attention(q, sm_scale=0.125)
    (prepared,) = cache._prepared.values()
    assert prepared.sm_scale == 0.125 and not prepared.launch.has_lens
    assert len(decode.launches) == 2 and [v for v in decode.bound[0].values] == [(13,), (14,), (15,)]
    out, lse = cache.attention(q, sm_scale=0.125, return_lse=True)
    assert len(cache._prepared) == 1 and len(decode.bound[0].values) == 4 and lse is not prepared.lse
    cache.attention(q, sm_scale=0.1)   # another scale: another prepared run
    assert len(cache._prepared) == 2 and "body" not in cache._lens


def test_a_query_that_records_gradients_gets_an_output_whose_backward_raises():
    """The cache's kernels have no backward: their output had no grad_fn, so a loss through the cache's attention
    trained the rest of a model and never q, silently. Now its backward raises by name (values unchanged); under
    no_grad nothing changes; target="reference" (torch ops in float64) keeps its gradient."""
    from foldc.errors import UnsupportedError

    gen = torch.Generator().manual_seed(17)
    cache = QuantizedKVCache(SPEC, 2, 40, sink=2, window=4, target="interpret")
    cache.append(*_tokens(cache, 30, gen))
    assert cache.body_tokens and cache.window_tokens   # two parts and their merge
    q = torch.randn(2, 4, 64, generator=gen).half().requires_grad_()
    plain, plain_lse = cache.attention(q.detach(), return_lse=True)
    out, lse = cache.attention(q, return_lse=True)
    assert torch.equal(out.detach(), plain) and torch.equal(lse.detach(), plain_lse)
    for y in (out, lse, cache.attention(q)):
        with pytest.raises(UnsupportedError, match=r"^QuantizedKVCache\.attention with target='interpret' has no "
                                                   r"backward.*target='reference'"):
            y.float().sum().backward()
    with torch.no_grad():
        assert not cache.attention(q).requires_grad
    reference = QuantizedKVCache(SPEC, 2, 40, sink=2, window=4, target="reference")
    reference.append(*_tokens(reference, 30, gen))
    reference.attention(q).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def test_a_decode_step_of_the_fast_path_with_a_query_that_records_gradients_raises_at_backward(monkeypatch):
    """The body-only decode step that runs the prepared attention straight away (stand-in launches on the CPU)
    returns an output whose backward raises, as the whole path's does."""
    from foldc.errors import UnsupportedError

    cache, decode = _stand_in_body(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    cache.append(*_tokens(cache, 10, gen))
    q = torch.randn(1, 8, 64, generator=gen).half()
    for _ in range(3):
        cache.append(*_tokens(cache, 1, gen))
        cache.attention(q, sm_scale=0.125)
    assert cache._attend is not None   # the next step takes the fast path
    whole = []
    monkeypatch.setattr(cache, "_raise_if_flagged", lambda: whole.append(1))   # the whole path's first step
    out = cache.attention(q.clone().requires_grad_(), sm_scale=0.125)
    assert whole == [] and out.requires_grad
    with pytest.raises(UnsupportedError, match=r"^QuantizedKVCache\.attention .* has no backward"):
        out.float().sum().backward()
    assert not cache.attention(q, sm_scale=0.125).requires_grad


@pytest.mark.parametrize("name, sink, window", [("K token2 / V channel4", 2, 5), ("K token4 / V token2 g32 bf16 scales",
                                                                                    0, 0),
                                                ("K token4 / V token2 g32 bf16 scales", 1, 3)])
@pytest.mark.parametrize("target", ["interpret", "reference"])
def test_a_deepcopy_holds_the_same_tokens_in_storage_of_its_own(name, sink, window, target):
    """transformers reuses a prompt's cache by ``copy.deepcopy`` (a FoldcCache's layers are these caches): Python's
    copy raised TypeError ("cannot pickle 'module' object") from inside the copy once a kernel had run. The copy
    holds the original's tokens; each then takes appends of its own without touching the other, each equal to a
    fresh cache given the same appends."""
    gen = torch.Generator().manual_seed(11)
    make = lambda: QuantizedKVCache(SPECS[name], 2, 80, sink=sink, window=window, target=target)  # noqa: E731
    cache, prompt = make(), [_tokens(make(), 21, gen, shift=1.0), *(_tokens(make(), 1, gen) for _ in range(3))]
    q = torch.randn(2, SPECS[name].num_q_heads, 64, generator=gen).half()
    for k, v in prompt:
        cache.append(k, v)
        cache.attention(q)
    twin = copy.deepcopy(cache)
    assert twin.num_tokens == cache.num_tokens and twin._body["k"].codes is not cache._body["k"].codes
    for c in (cache, twin):   # each its own continuation: a step of several tokens, then decode steps
        rest = [_tokens(c, 9, gen, shift=-1.0), *(_tokens(c, 1, gen) for _ in range(4))]
        fresh = make()
        for k, v in [*prompt, *rest]:
            fresh.append(k, v)
        for k, v in rest:
            c.append(k, v)
        for got, want in zip(c.dequantized(), fresh.dequantized()):
            assert torch.equal(got, want)
        assert torch.equal(c.attention(q), fresh.attention(q))


def test_a_deepcopy_of_a_cache_a_one_token_append_flagged_raises_as_the_original():
    gen = torch.Generator().manual_seed(12)
    cache = QuantizedKVCache(SPECS["K token4 / V token2 g32 bf16 scales"], 2, 40, target="interpret")
    cache.append(*_tokens(cache, 6, gen))
    k, v = _tokens(cache, 1, gen)
    k[1, 0, 0, 3] = float("nan")
    cache.append(k, v)   # flagged by the append kernel, raised by the next call
    twin = copy.deepcopy(cache)
    q = torch.randn(2, 4, 64, generator=gen).half()
    for c in (cache, twin):
        with pytest.raises(InputError, match="a one-token append held NaN or Inf"):
            c.attention(q)


@pytest.mark.parametrize("target", ["interpret", "reference"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_sparse_tokens_and_queries_are_refused_by_name_and_change_nothing(target, tokens):
    """Sparse keys or values raised NotImplementedError from inside torch's norm; a sparse query was told to pass
    q.contiguous() for its strides (0, 0, 0). Each is an `InputError` naming the layout now, and the cache holds and
    attends as before."""
    gen = torch.Generator().manual_seed(23 + tokens)
    cache = QuantizedKVCache(foldc.AttentionSpec(4, 2, 64, A(4, "token", 32), A(4, "channel", 16)), 2, 64, sink=1,
                             window=2, target=target)
    cache.append(*_tokens(cache, 21, gen, shift=0.5))
    before = cache.dequantized()
    k, v = _tokens(cache, tokens, gen)
    for args in ((k.to_sparse(), v), (k, v.to_sparse())):
        with pytest.raises(InputError, match=r"[kv]_new is a tensor of layout torch\.sparse_coo; .*\.to_dense\(\)"):
            cache.append(*args)
    after = cache.dequantized()
    assert cache.num_tokens == 21 and all(torch.equal(a, b) for a, b in zip(after, before))
    q = torch.randn(2, 4, 64, generator=gen).half()
    with pytest.raises(InputError, match=r"q is a tensor of layout torch\.sparse_coo; .* q\.to_dense\(\)"):
        cache.attention(q.to_sparse())
    assert rel_err(cache.attention(q), foldc.attention_reference(q, *after)) < TOL
