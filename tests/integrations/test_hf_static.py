"""FoldcStaticCache: the same tokens and logits as FoldcCache over the same bits, a decode step that
traces into one graph (torch.compile, fullgraph) and gives the eager step's logits, and refusals.

CPU: the float32 model with target="reference" (the float64 executor; appends by foldc.quantize),
and the float16 model under the interpreter. The GPU run is examples/hf_decode.py --static.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
fhf = pytest.importorskip("foldc.integrations.hf")

from foldc.errors import InputError, SpecError  # noqa: E402
from foldc.integrations.hf_static import FoldcStaticCache  # noqa: E402

from test_hf import PROMPT, attention, generate, llama, prompt  # noqa: E402


@pytest.mark.parametrize("dtype,target,k,v", [
    (torch.float32, "reference", "token:4:16", "token:2:32"),
    (torch.float32, "reference", "token:4:32", None),
    (torch.float16, "interpret", "token:4:32", "token:4:32"),
])
def test_static_cache_decodes_like_foldc_cache(dtype, target, k, v):
    model, ids = llama(dtype=dtype), prompt(2)
    seq, logits = generate(model, fhf.FoldcCache(model.config, 32, k=k, v=v, target=target), ids, new=6)
    static = FoldcStaticCache(model, 32, k=k, v=v, target=target)
    seq_s, logits_s = generate(model, static, ids, new=6)
    assert torch.equal(seq, seq_s)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert float((logits - logits_s).abs().max()) <= tol * float(logits.abs().max())
    layer = static.layers[0]
    assert int(layer.length) == PROMPT + 5 and layer.row_lengths.tolist() == [PROMPT + 5] * 2
    assert torch.equal(layer.k.codes[:, :, :PROMPT + 5], layer.cache._body["k"].codes[:, :, :PROMPT + 5])


@torch.no_grad()
def test_a_decode_step_traces_into_one_graph_with_the_eager_logits():
    """torch.compile(fullgraph=True) of a decode step: no graph break (the appends and the attention
    are custom ops; the lengths live on the device), and the compiled step's logits are the eager
    step's, on two caches filled alike."""
    torch._dynamo.reset()
    model, ids = llama(dtype=torch.float32), prompt(2)
    caches = [FoldcStaticCache(model, 32, k="token:4:16", v="token:4:16", target="reference") for _ in range(2)]
    step = torch.compile(model, backend="aot_eager", fullgraph=True)
    with attention(model, "foldc"):
        outs = []
        for cache, run in zip(caches, (model, step)):
            model(ids, use_cache=True, **{fhf.CACHE_KWARG: cache})   # the prompt, eager
            logits = []
            for t in range(3):
                token = ids[:, t:t + 1]
                logits.append(run(token, use_cache=True, **{fhf.CACHE_KWARG: cache}).logits[:, -1])
            outs.append(torch.stack(logits))
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-5 * float(outs[0].abs().max()))
    assert int(caches[1].layers[1].length) == PROMPT + 3


def test_refusals_name_the_value_and_the_fix():
    model, ids = llama(dtype=torch.float32), prompt(1)
    with pytest.raises(SpecError, match="takes the transformers model itself"):
        FoldcStaticCache(model.config, 32, k="token:4:16", v="token:4:16")
    with pytest.raises(SpecError, match="channel:2:16.*token-wise"):
        FoldcStaticCache(model, 32, k="channel:2:16", v="token:4:16", target="reference")
    cache = FoldcStaticCache(model, 32, k="token:4:16", v="token:4:16", target="reference")
    with attention(model, "foldc"), torch.no_grad():
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: cache})
        with pytest.raises(InputError, match="second prompt.*reset"):
            model(ids, use_cache=True, **{fhf.CACHE_KWARG: cache})
        cache.reset()
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: cache})   # after reset: a new prompt
        assert int(cache.layers[0].length) == PROMPT
    full = FoldcStaticCache(model, PROMPT + 1, k="token:4:16", v="token:4:16", target="reference")
    with attention(model, "foldc"), torch.no_grad():
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: full})
        model(ids[:, :1], use_cache=True, **{fhf.CACHE_KWARG: full})   # the last token that fits
        with pytest.raises(InputError, match=r"max_cache_len=13\) is full"):
            model(ids[:, :1], use_cache=True, **{fhf.CACHE_KWARG: full})
    small = FoldcStaticCache(model, PROMPT - 1, k="token:4:16", v="token:4:16", target="reference")
    with attention(model, "foldc"), torch.no_grad(), pytest.raises(InputError, match="does not fit"):
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: small})


@settings(max_examples=20, deadline=None)
@given(sides=st.sampled_from([("token:4:16", None), (None, "token:2:32"), ("token:4:16", "token:4:16")]),
       bad=st.sampled_from(["key_states", "value_states"]), batch=st.sampled_from([1, 2, 3]),
       heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31 - 1))
@torch.no_grad()
def test_a_decode_step_of_another_batch_or_head_count_is_refused_before_any_write(sides, bad, batch, heads, seed):
    """A decode step into a plain side whose batch or KV heads differed from the storage raised a RuntimeError from
    inside torch's index_copy_ (after an encoded side had been written). Either side is refused by name now, nothing
    written; the step of the storage's shape then goes in."""
    model, ids = llama(dtype=torch.float32), prompt(2, seed=seed)
    cache = FoldcStaticCache(model, 32, k=sides[0], v=sides[1], target="reference")
    with attention(model, "foldc"):
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: cache})
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(seed)
    step = {name: torch.randn(2, 2, 1, 32, generator=gen) for name in ("key_states", "value_states")}
    shape = (batch, heads, 1, 32)
    if shape == (2, 2, 1, 32):
        shape = (2, 2, 1, 16)   # the head_dim differs instead
    wrong = dict(step, **{bad: torch.randn(shape, generator=gen)})
    before = [t.clone() for t in layer._tensors()]
    with pytest.raises(InputError, match=re.escape(f"{bad} shape={shape} but FoldcStaticCache holds 2 sequences of "
                                                   "2 KV heads of head_dim 32")):
        layer.update(wrong["key_states"], wrong["value_states"])
    assert all(torch.equal(a, b) for a, b in zip(layer._tensors(), before))
    layer.update(step["key_states"], step["value_states"])
    assert int(layer.length) == PROMPT + 1


def _last_logits(model, cache, ids, steps=()):
    out = model(ids, use_cache=True, **{fhf.CACHE_KWARG: cache}).logits[:, -1]
    for t in steps:
        out = model(t, use_cache=True, **{fhf.CACHE_KWARG: cache}).logits[:, -1]
    return out


@torch.no_grad()
def test_after_reset_the_next_prompt_attends_like_a_fresh_cache():
    """reset() zeroed the device counts but not the host cache that stores a prompt: the second prompt
    was written after the first one's tokens while attention read from token 0 (logits 100% off)."""
    model, ids = llama(dtype=torch.float32), prompt(2)
    other = torch.randint(2, 128, ids.shape, generator=torch.Generator().manual_seed(11))
    used = FoldcStaticCache(model, 32, k="token:4:16", v="token:4:16", target="reference")
    with attention(model, "foldc"):
        _last_logits(model, used, ids, [ids[:, :1], ids[:, 1:2]])
        used.reset()
        got = _last_logits(model, used, other, [other[:, :1], other[:, 1:2]])
        want = _last_logits(model, FoldcStaticCache(model, 32, k="token:4:16", v="token:4:16", target="reference"),
                            other, [other[:, :1], other[:, 1:2]])
    assert torch.equal(got, want)
    assert int(used.layers[0].length) == PROMPT + 2 and used.layers[0].cache.num_tokens == PROMPT


@torch.no_grad()
def test_after_reset_a_prompt_of_another_batch_names_the_fix():
    """reset() keeps the storage (captured graphs read it): a prompt of another batch is refused with the fix (build
    a new FoldcStaticCache), not the inner cache's shape message."""
    model = llama(dtype=torch.float32)
    used = FoldcStaticCache(model, 32, k="token:4:16", v="token:4:16", target="reference")
    with attention(model, "foldc"):
        _last_logits(model, used, prompt(2))
        used.reset()
        with pytest.raises(InputError, match="built for 2 sequences .* prompt has 3; build a new FoldcStaticCache"):
            _last_logits(model, used, prompt(3))


@torch.no_grad()
def test_a_forward_with_another_cache_does_not_read_the_static_one():
    """The model stays bound to its FoldcStaticCache; a later one-token forward with a DynamicCache (or
    no cache) used to attend over the static cache's tokens instead of its own (logits 165% off)."""
    model, ids = llama(dtype=torch.float32), prompt(2)
    with attention(model, "foldc"):
        _last_logits(model, FoldcStaticCache(model, 32, k="token:4:16", v="token:4:16", target="reference"), ids,
                     [ids[:, :1]])
        got = [model(ids[:, :1], use_cache=True, **{fhf.CACHE_KWARG: transformers.DynamicCache()}).logits,
               model(ids[:, :1], use_cache=False).logits]
    with attention(model, "sdpa"):
        want = model(ids[:, :1], use_cache=False).logits
    for g in got:
        assert torch.allclose(g, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("other", ["copy", "instance"])
@torch.no_grad()
def test_a_model_the_cache_is_not_bound_to_is_refused_before_its_first_decode_step(other):
    """The decode attention finds a FoldcStaticCache's layers through the attention modules of the model it was built
    from. Another model (a copy.deepcopy of it, another instance of the same weights) took the prompt, then attended
    each decode step over its new token alone (logits 3.6 off, other tokens, silently). Refused at the first decode
    step now, before it writes, until reset(); the bound model then decodes as a fresh cache does."""
    import copy

    model, ids = llama(dtype=torch.float32), prompt(2)
    model.set_attn_implementation("foldc")
    cache = FoldcStaticCache(model, 32, k="token:4:16", v="token:4:16", target="reference")
    runner = copy.deepcopy(model) if other == "copy" else llama(dtype=torch.float32)   # the same weights
    with attention(runner, "foldc"):
        with pytest.raises(SpecError, match=r"did not read this FoldcStaticCache.*FoldcStaticCache\(model, \.\.\.\) "
                                            r"from the model that runs"):
            runner.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                            **{fhf.CACHE_KWARG: cache})
        assert int(cache.layers[0].length) == PROMPT   # the prompt only: the decode step wrote nothing
        with pytest.raises(SpecError, match="did not read this FoldcStaticCache"):   # until reset()
            runner(ids[:, :1], use_cache=True, **{fhf.CACHE_KWARG: cache})
    cache.reset()
    seq, logits = generate(model, cache, ids, new=4)
    want_seq, want_logits = generate(model, FoldcStaticCache(model, 32, k="token:4:16", v="token:4:16",
                                                             target="reference"), ids, new=4)
    assert torch.equal(seq, want_seq) and torch.equal(logits, want_logits)


@settings(max_examples=6, deadline=None)
@given(row=st.integers(0, 1), hidden=st.integers(1, PROMPT), seed=st.integers(0, 2**31 - 1))
@torch.no_grad()
def test_an_eager_decode_step_with_a_padding_mask_is_refused(row, hidden, seed):
    """A decode step whose mask hides some of a row's cached tokens (a serving loop's own masks) attended over every
    token of FoldcStaticCache, the mask ignored (DynamicCache honours it, FoldcCache refuses it: silently other
    logits). Refused eagerly now, as FoldcCache does; an all-ones mask decodes as no mask."""
    model, ids = llama(dtype=torch.float32), prompt(2, seed=seed)
    cache = FoldcStaticCache(model, 32, k="token:4:16", v="token:4:16", target="reference")
    kw = {fhf.CACHE_KWARG: cache, "use_cache": True}
    mask = torch.ones(2, PROMPT + 1, dtype=torch.long)
    mask[row, :hidden] = 0
    with attention(model, "foldc"):
        model(ids, attention_mask=torch.ones_like(ids), **kw)
        with pytest.raises(InputError, match="padding masks are not supported"):
            model(ids[:, :1], attention_mask=mask, **kw)
        cache.reset()
        model(ids, **kw)
        got = model(ids[:, :1], attention_mask=torch.ones(2, PROMPT + 1, dtype=torch.long), **kw).logits
        cache.reset()
        model(ids, **kw)
        want = model(ids[:, :1], **kw).logits
    assert torch.equal(got, want)


@torch.no_grad()
def test_a_compiled_prompt_after_tokens_attends_to_them():
    """A compiled (traced) prompt into a FoldcStaticCache that held tokens (a prompt in chunks: chunked prefill, a
    later turn) went to SDPA over its own chunk, where the host check that refuses it eagerly does not run: under
    fullgraph it did not compile (the padding check's torch.equal), without it was refused as padding. Traced, a
    prompt now attends over the tokens held and its own: the first chunk eager, the second and two decode steps
    compiled give the logits of FoldcCache fed the same chunks eagerly (which attends over the held tokens
    dequantized and the chunk's own), and store the same bits."""
    torch._dynamo.reset()
    seed = int(torch.randint(0, 1000, ()))
    model, ids = llama(dtype=torch.float32), prompt(2, seed=seed)
    cut = 5
    chunks = [ids[:, :cut], ids[:, cut:], ids[:, :1], ids[:, 1:2]]   # the prompt in two chunks, two decode steps
    eager_cache = fhf.FoldcCache(model.config, 32, k="token:4:16", v="token:2:16", target="reference")
    static = FoldcStaticCache(model, 32, k="token:4:16", v="token:2:16", target="reference")
    step = torch.compile(model, backend="aot_eager", fullgraph=True)
    with attention(model, "foldc"):
        want = [model(c, use_cache=True, **{fhf.CACHE_KWARG: eager_cache}).logits for c in chunks]
        got = [model(chunks[0], use_cache=True, **{fhf.CACHE_KWARG: static}).logits]   # the first prompt, eager
        got += [step(c, use_cache=True, **{fhf.CACHE_KWARG: static}).logits for c in chunks[1:]]
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.allclose(g, w, rtol=0, atol=1e-4 * float(w.abs().max())), (seed, i, float((g - w).abs().max()))
    layer = static.layers[0]
    assert int(layer.length) == PROMPT + 2
    held = eager_cache.layers[0].cache
    assert torch.equal(layer.k.codes[:, :, :PROMPT + 2], held._body["k"].codes[:, :, :PROMPT + 2])


@torch.no_grad()
def test_a_compiled_step_past_the_storage_skips_a_plain_sides_token():
    """A compiled decode step past max_cache_len (where the host reads no count) wrote a plain side with index_copy_
    at a position past the storage: IndexError from inside torch on the CPU (a device-side assert on a GPU), after
    the quantized side's append had skipped its token. The plain side now skips it too (its storage unchanged), and
    the step is refused by the attention, naming the lengths."""
    torch._dynamo.reset()
    model, ids = llama(dtype=torch.float32), prompt(2, seed=int(torch.randint(0, 1000, ())))
    cap = PROMPT + 2
    static = FoldcStaticCache(model, cap, k="token:4:16", v=None, target="reference")
    step = torch.compile(model, backend="aot_eager", fullgraph=True)
    with attention(model, "foldc"):
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: static})   # the prompt, eager
        v = static.layers[0].v
        for t in range(2):   # the storage's last two slots
            before = v.clone()
            step(ids[:, t:t + 1], use_cache=True, **{fhf.CACHE_KWARG: static})
            assert not torch.equal(v[:, :, PROMPT + t], before[:, :, PROMPT + t])
        before = v.clone()
        with pytest.raises(InputError, match=f"seq_lens holds {cap + 1} but the cache holds {cap} tokens"):
            step(ids[:, 2:3], use_cache=True, **{fhf.CACHE_KWARG: static})
    assert torch.equal(v, before)


@torch.no_grad()
@pytest.mark.parametrize("v", [None, "token:2:16"])
def test_a_compiled_chunk_past_the_storage_keeps_the_last_slots_token(v):
    """A compiled prompt chunk that runs past max_cache_len clamped its positions to the last slot: the chunk's
    tokens past the storage were copied there after the token that belongs there, so that token (inside the
    storage) attended over another one's key and value, silently. Its tokens inside the storage now give the
    logits FoldcCache gives for the same chunk."""
    torch._dynamo.reset()
    seed = int(torch.randint(0, 1000, ()))
    model, ids = llama(dtype=torch.float32), prompt(2, seed=seed)
    chunk, free = prompt(2, seed=seed + 1)[:, :6], 3
    static = FoldcStaticCache(model, PROMPT + free, k="token:4:16", v=v, target="reference")
    eager = fhf.FoldcCache(model.config, 32, k="token:4:16", v=v, target="reference")
    step = torch.compile(model, backend="aot_eager", fullgraph=True)
    with attention(model, "foldc"):
        for cache in (static, eager):
            model(ids, use_cache=True, **{fhf.CACHE_KWARG: cache})   # the first prompt, eager
        got = step(chunk, use_cache=True, **{fhf.CACHE_KWARG: static}).logits[:, :free]
        want = model(chunk, use_cache=True, **{fhf.CACHE_KWARG: eager}).logits[:, :free]
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * float(want.abs().max())), (seed, (got - want).abs().max())


def _fused(kind, seed):
    """A tiny random model whose attention projects q, k and v in one linear (Phi-3's qkv_proj, GPT-NeoX's
    query_key_value)."""
    torch.manual_seed(seed)
    if kind == "phi3":
        cfg = transformers.Phi3Config(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
                                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                                      sliding_window=None)
        return transformers.Phi3ForCausalLM(cfg).eval()
    cfg = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=128, max_position_embeddings=128, initializer_range=0.1,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return transformers.GPTNeoXForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["phi3", "gpt_neox"])
@pytest.mark.parametrize("seed", [0, 1])
def test_models_with_fused_qkv_projections_bind_and_decode_like_foldc_cache(kind, seed):
    """FoldcStaticCache bound only attention modules with a q_proj: Phi-3, GPT-NeoX, Falcon and GPTBigCode were refused
    ("use FoldcCache"). Modules with a fused projection bind too, and decode FoldcCache's tokens and logits."""
    model = _fused(kind, seed)
    ids = torch.randint(2, 128, (2, PROMPT), generator=torch.Generator().manual_seed(seed))
    seq, logits = generate(model, fhf.FoldcCache(model.config, 32, k="token:4:16", v="token:2:16",
                                                 target="reference"), ids, new=5)
    static = FoldcStaticCache(model, 32, k="token:4:16", v="token:2:16", target="reference")
    seq_s, logits_s = generate(model, static, ids, new=5)
    assert torch.equal(seq, seq_s)
    assert float((logits - logits_s).abs().max()) <= 1e-5 * float(logits.abs().max())
    assert int(static.layers[1].length) == PROMPT + 4


def test_an_alibi_model_is_refused_by_name():
    cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                                    alibi=True, new_decoder_architecture=False, multi_query=True)
    model = transformers.FalconForCausalLM(cfg).eval()
    with pytest.raises(SpecError, match="ALiBi"):
        FoldcStaticCache(model, 32, k="token:4:16", v=None, target="reference")
