"""transformers integration: greedy generate through FoldcCache and the "foldc" attention.

Tiny randomly initialised models (no weights are downloaded). Three references:

- the default cache (DynamicCache with SDPA): same tokens and logits within float16 rounding when
  the cache keeps tokens plain, within the 8-bit quantization error for 8-bit codes;
- float64 attention over the cache's dequantized tokens at every decode step of every layer, and
  DequantizedFoldcCache (the same quantized cache, dequantize-then-SDPA in float32) for the logits:
  the fused decode must match them whatever the encoding (INT4, INT2, sink and window);
- the float32 model with target="reference" (float64 executor): equal to float32 rounding.

Logits are compared teacher-forced: each reference replays the token sequence the foldc run
generated, so a near-tie that flips one token cannot make later steps incomparable.
"""
from __future__ import annotations

import contextlib
import copy
import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
fhf = pytest.importorskip("foldc.integrations.hf")

from transformers import (AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          Qwen2Config, Qwen2ForCausalLM)

import foldc  # noqa: E402
from foldc.errors import InputError, SpecError  # noqa: E402

# Tolerances. ATTN is relative (Frobenius) per decode step and layer; the others are relative to
# the largest |logit| of the reference (about 3 for these models).
# - ATTN: the fused decode against float64 attention over the cache's dequantized tokens, as they
#   stand at that step: the bound tests/serving holds float16 attention to (fp16 operands of the
#   folded products, output rounding). Measured: at most 4.5e-4, as large as float16 SDPA's error
#   over the same tokens (4e-4).
# - FP16: two float16 attentions over the same float16 tokens differ by output rounding (2**-11
#   relative) and accumulation order; two layers carry that to the logits. Measured: 1.2e-3..1.4e-3.
# - DEQUANT: logits against the float32 dequantize-then-attend cache replaying the same tokens. The
#   float16 rounding compounds over the steps, and a replayed key that moved by one rounding can
#   land on the other side of a code boundary (one INT2 step is a third of the group's range).
#   Measured: 1.2e-3..1.8e-2; float16 SDPA over that same cache is as far (7e-3..1.6e-2). The
#   quantization error it separates from is 3.4e-2..4.3e-1 (INT4, INT2, against the default cache).
# - INT8: 8-bit codes against the unquantized model. Measured 4.7e-3.
# - FP32: target="reference" in float32 against float32 SDPA: measured 3.8e-7.
ATTN_TOL = 2e-3
FP16_TOL = 4 * 2.0 ** -10
DEQUANT_TOL = 5e-2
INT8_TOL = 2e-2
FP32_TOL = 1e-5
PROMPT, NEW = 12, 10


@pytest.fixture(scope="module", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    """Kernels compiled here go to a temporary folder, never to the user's ~/.cache/foldc."""
    old = os.environ.get("FOLDC_CACHE_DIR")
    os.environ["FOLDC_CACHE_DIR"] = str(tmp_path_factory.mktemp("foldc_hf_cache"))
    yield
    if old is None:
        os.environ.pop("FOLDC_CACHE_DIR", None)
    else:
        os.environ["FOLDC_CACHE_DIR"] = old


def llama(head_dim=32, dtype=torch.float16, seed=0):
    """A tiny random Llama: 2 layers, 4 query heads over 2 KV heads (GQA). initializer_range=0.1
    gives logits of a few units and attention that is far from uniform."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=head_dim, vocab_size=128, max_position_embeddings=128,
                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def qwen2(dtype=torch.float16, seed=1):
    """A tiny random Qwen2 (q/k/v biases, head_dim 128/4 = 32)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, initializer_range=0.1,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return Qwen2ForCausalLM(cfg).eval().to(dtype)


def prompt(batch, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, PROMPT), generator=gen)


@contextlib.contextmanager
def attention(model, impl):
    old = model.config._attn_implementation
    model.set_attn_implementation(impl)
    try:
        yield model
    finally:
        model.set_attn_implementation(old)


@contextlib.contextmanager
def checked_decode():
    """Wrap the "foldc" attention: every decode step of a FoldcCache is also computed in float64 over
    the cache's dequantized tokens; yields the list of relative errors it fills."""
    errors = []

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out, weights = fhf.foldc_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        layer, step = getattr(key, fhf._TAG, (None, None))
        if step == "decode":
            k, v = layer.cache.dequantized()
            ref = foldc.attention_reference(query[:, :, 0], k, v, sm_scale=scaling)
            errors.append(float((out[:, 0].double() - ref).norm() / ref.norm()))
        return out, weights

    AttentionInterface.register(fhf.ATTN_IMPLEMENTATION, attend)
    try:
        yield errors
    finally:
        fhf.register()


def generate(model, cache, ids, new=NEW, impl="foldc"):
    """Greedy generate: (sequences, float32 logits [new, batch, vocab])."""
    with attention(model, impl):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **{fhf.CACHE_KWARG: cache})
    return out.sequences, torch.stack(out.logits).float()


@torch.no_grad()
def replay(model, cache, seq, impl="foldc"):
    """Teacher-forced logits of ``seq``: the prompt in one forward, then one token per step, as
    generate feeds them ([steps, batch, vocab], the same steps as `generate`'s logits)."""
    with attention(model, impl):
        out = model(seq[:, :PROMPT], use_cache=True, **{fhf.CACHE_KWARG: cache})
        logits = [out.logits[:, -1]]
        for t in range(PROMPT, seq.shape[1] - 1):
            out = model(seq[:, t:t + 1], use_cache=True, **{fhf.CACHE_KWARG: cache})
            logits.append(out.logits[:, -1])
    return torch.stack(logits).float()


def diff(logits, ref) -> tuple[float, float]:
    """(max |difference| / max |ref|, relative Frobenius difference)."""
    return float((logits - ref).abs().max() / ref.abs().max()), float((logits - ref).norm() / ref.norm())


def cache(model, k, v, **kw):
    kw.setdefault("target", "interpret" if model.dtype == torch.float16 else "reference")
    return fhf.FoldcCache(model.config, PROMPT + NEW + 8, k=k, v=v, **kw)


def dequantized(model, k, v, **kw):
    kw.setdefault("target", "interpret" if model.dtype == torch.float16 else "reference")
    return fhf.DequantizedFoldcCache(model.config, PROMPT + NEW + 8, k=k, v=v, **kw)


# ---- against the default cache ------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 2])
def test_plain_cache_generates_what_the_default_cache_generates(batch):
    model, ids = llama(), prompt(batch)
    seq, logits = generate(model, cache(model, None, None), ids)
    ref_seq, ref_logits = generate(model, DynamicCache(config=model.config), ids, impl="sdpa")
    worst, _ = diff(logits, ref_logits)
    assert torch.equal(seq, ref_seq), f"tokens differ (logit difference {worst:.2e} of max)"
    assert worst < FP16_TOL, f"logits differ by {worst:.2e} of max"


def test_int8_cache_generates_what_the_default_cache_generates():
    model, ids = llama(), prompt(2)
    c = cache(model, "token:8:32", "channel:8:16", window=2)
    with checked_decode() as errors:
        seq, logits = generate(model, c, ids)
    assert len(errors) == 2 * (NEW - 1) and max(errors) < ATTN_TOL
    ref_seq, _ = generate(model, DynamicCache(config=model.config), ids, impl="sdpa")
    assert torch.equal(seq, ref_seq)
    assert c.layer_caches[0].body_tokens == 16  # channel groups of 16 reached the quantized body
    worst, _ = diff(logits, replay(model, DynamicCache(config=model.config), seq, impl="sdpa"))
    assert worst < INT8_TOL, f"8-bit logits differ from the unquantized model by {worst:.2e} of max"


def test_foldc_attention_without_a_foldc_cache_is_sdpa():
    """The "foldc" implementation with the default cache takes its SDPA path on every step (causal
    prefill, GQA by repeating KV heads, decode over the returned keys)."""
    model, ids = llama(dtype=torch.float32), prompt(2)
    seq, logits = generate(model, DynamicCache(config=model.config), ids)
    ref_seq, ref_logits = generate(model, DynamicCache(config=model.config), ids, impl="sdpa")
    assert torch.equal(seq, ref_seq) and diff(logits, ref_logits)[0] < FP32_TOL


@pytest.mark.parametrize("batch", [1, 2])
def test_foldc_attention_over_transformers_static_cache_is_sdpa(batch):
    """A prompt into an empty transformers StaticCache reaches the attention with every slot of the cache as its key
    (max_cache_len, the prompt's first) and no mask: transformers' SDPA attends causally from the first key
    (upper-left). The "foldc" attention aligned the causal mask to the last key, so each prompt token attended to
    the empty slots and not to itself: other tokens, logits 1.36 of the max off on one seed, silently."""
    from transformers import StaticCache

    seed = int(torch.randint(0, 2**16, ()))
    model, ids = llama(dtype=torch.float32, seed=seed), prompt(batch, seed=seed)
    seq, logits = generate(model, StaticCache(config=model.config, max_cache_len=PROMPT + NEW + 8), ids)
    ref_seq, ref_logits = generate(model, StaticCache(config=model.config, max_cache_len=PROMPT + NEW + 8), ids,
                                   impl="sdpa")
    assert torch.equal(seq, ref_seq) and diff(logits, ref_logits)[0] < FP32_TOL, f"seed {seed}"


# ---- low-bit encodings: the same cache, dequantized ---------------------------------------------

LOW_BIT = {
    # name: (head_dim, batch, k, v, sink, window, bound on the relative difference to the unquantized model)
    "int4 token/token": (32, 2, "token:4:32", "token:4:32", 0, 0, 0.2),
    "int4 token/channel, sink 1, window 4": (32, 2, "token:4:16", "channel:4:16", 1, 4, 0.2),
    "int2 token/token": (64, 1, "token:2:64", "token:2:64", 0, 0, 0.6),
    "int2 channel/token, sink 1, window 3": (64, 2, "channel:2:16", "token:2:32", 1, 3, 0.6),
}


@pytest.mark.parametrize("name", list(LOW_BIT))
def test_low_bit_decode_equals_dequantize_then_attend(name):
    head_dim, batch, k, v, sink, window, bound = LOW_BIT[name]
    model, ids = llama(head_dim), prompt(batch)
    c = cache(model, k, v, sink=sink, window=window)
    with checked_decode() as errors:
        seq, logits = generate(model, c, ids)
    assert seq.shape == (batch, PROMPT + NEW) and torch.isfinite(logits).all()
    assert len(errors) == 2 * (NEW - 1) and max(errors) < ATTN_TOL, f"decode attention errors up to {max(errors):.2e}"
    # every layer holds every token but the last generated one, split as the cache promises
    n = PROMPT + NEW - 1
    for layer in c.layer_caches:
        assert layer.num_tokens == n and layer.sink_tokens == min(sink, n)
        assert layer.body_tokens == (n - sink - window) // layer.unit * layer.unit > 0
    worst, _ = diff(logits, replay(model, dequantized(model, k, v, sink=sink, window=window), seq))
    assert worst < DEQUANT_TOL, f"fused decode differs from dequantize-then-attend by {worst:.2e} of max"
    _, rel = diff(logits, replay(model, DynamicCache(config=model.config), seq, impl="sdpa"))
    assert rel < bound, f"{name}: logits differ from the unquantized model by {rel:.2e} (relative)"


def test_qwen2_decodes_through_foldc():
    model, ids = qwen2(), prompt(3)
    seq, logits = generate(model, cache(model, None, None), ids)
    ref_seq, ref_logits = generate(model, DynamicCache(config=model.config), ids, impl="sdpa")
    assert torch.equal(seq, ref_seq) and diff(logits, ref_logits)[0] < FP16_TOL
    with checked_decode() as errors:
        seq, logits = generate(model, cache(model, "token:8:32", "token:4:32"), ids)
    assert len(errors) == 2 * (NEW - 1) and max(errors) < ATTN_TOL
    worst, _ = diff(logits, replay(model, dequantized(model, "token:8:32", "token:4:32"), seq))
    assert worst < DEQUANT_TOL


# ---- float32 with the float64 executor -----------------------------------------------------------

def test_reference_target_in_float32_is_exact():
    """target="reference" (any dtype): the folded plan in float64 against float32 SDPA over the
    same dequantized tokens, with a scaling that is not 1/sqrt(head_dim)."""
    model, ids = llama(dtype=torch.float32), prompt(2)
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.3
    seq, logits = generate(model, cache(model, "token:4:32", "channel:2:16", sink=1, window=3), ids)
    worst, _ = diff(logits, replay(model, dequantized(model, "token:4:32", "channel:2:16", sink=1, window=3), seq))
    assert worst < FP32_TOL
    seq, logits = generate(model, cache(model, None, None), ids)
    ref_seq, ref_logits = generate(model, DynamicCache(config=model.config), ids, impl="sdpa")
    assert torch.equal(seq, ref_seq) and diff(logits, ref_logits)[0] < FP32_TOL


def test_a_window_that_holds_every_token_is_the_plain_cache():
    model, ids = llama(dtype=torch.float32), prompt(2)
    c = cache(model, "token:2:32", "token:2:32", window=64)
    seq, logits = generate(model, c, ids)
    assert c.layer_caches[0].body_tokens == 0
    plain_seq, plain_logits = generate(model, cache(model, None, None), ids)
    assert torch.equal(seq, plain_seq) and diff(logits, plain_logits)[0] < FP32_TOL


def test_a_prompt_in_two_chunks_attends_over_the_cached_chunk():
    """A second prefill (query length > 1) attends over the cached tokens, dequantized, then decodes."""
    model, ids = llama(dtype=torch.float32), prompt(2)
    with attention(model, "foldc"), torch.no_grad():
        results = []
        for c in (cache(model, None, None), DynamicCache(config=model.config)):
            kw = {fhf.CACHE_KWARG: c, "use_cache": True}
            first = model(ids[:, :7], **kw).logits
            second = model(ids[:, 7:], **kw).logits
            step = model(ids[:, -1:], **kw).logits
            results.append(torch.cat([first, second, step], dim=1))
        foldc_logits, ref_logits = results
    assert diff(foldc_logits, ref_logits)[0] < FP32_TOL
    # quantized: the second chunk sees the first through its dequantized codes, as the decode does
    c, d = cache(model, "token:4:32", "token:4:32"), dequantized(model, "token:4:32", "token:4:32")
    with attention(model, "foldc"), torch.no_grad():
        got = [model(part, use_cache=True, **{fhf.CACHE_KWARG: c}).logits for part in (ids[:, :7], ids[:, 7:])]
        want = [model(part, use_cache=True, **{fhf.CACHE_KWARG: d}).logits for part in (ids[:, :7], ids[:, 7:])]
    assert torch.equal(got[1], want[1])


def test_reset_forgets_the_tokens_and_the_batch_size():
    model = llama(dtype=torch.float32)
    c = cache(model, "token:4:32", None, sink=2, window=2)
    generate(model, c, prompt(2), new=3)
    c.reset()
    assert c.get_seq_length() == 0 and c.layer_caches == [None, None]
    seq, logits = generate(model, c, prompt(1, seed=3))
    fresh_seq, fresh_logits = generate(model, cache(model, "token:4:32", None, sink=2, window=2), prompt(1, seed=3))
    assert torch.equal(seq, fresh_seq) and torch.equal(logits, fresh_logits)


# ---- what is refused, and how ---------------------------------------------------------------------

def test_padding_masks_are_refused():
    model, ids = llama(dtype=torch.float32), prompt(2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with attention(model, "foldc"), pytest.raises(InputError, match="padding masks are not supported"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       **{fhf.CACHE_KWARG: cache(model, None, None)})
    # refused at the prompt already (a forward without decode steps), and at a decode step
    with attention(model, "foldc"), torch.no_grad():
        with pytest.raises(InputError, match="padding masks are not supported"):
            model(ids, attention_mask=mask, use_cache=True, **{fhf.CACHE_KWARG: cache(model, None, None)})
        c = cache(model, None, None)
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: c})
        step_mask = torch.ones(2, PROMPT + 1, dtype=torch.long)
        step_mask[0, 0] = 0
        with pytest.raises(InputError, match="padding masks are not supported"):
            model(ids[:, :1], attention_mask=step_mask, use_cache=True, **{fhf.CACHE_KWARG: c})


def test_a_decode_mask_is_read_once_per_forward(monkeypatch):
    """Reading a mask waits for the GPU: a decode step's mask is read by the first layer it reaches (the layers
    of one forward share it), a prompt's by each layer (its causal check)."""
    model, ids = llama(dtype=torch.float32), prompt(2)
    reads = []
    real = fhf._allowed
    monkeypatch.setattr(fhf, "_allowed", lambda mask: reads.append(mask.shape) or real(mask))
    with attention(model, "foldc"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                       **{fhf.CACHE_KWARG: cache(model, None, None)})
    layers = model.config.num_hidden_layers
    prompt_reads = [shape for shape in reads if shape[-2] == PROMPT]
    assert len(prompt_reads) <= layers and len(reads) - len(prompt_reads) <= 3, reads   # 3 decode forwards


def test_a_padded_decode_step_after_a_chunked_prompt_is_refused():
    """A prompt in two chunks with all-ones masks, then a decode step whose mask hides row 0's first tokens (a
    serving loop's own masks): refused (the prompt's mask passing once let later steps' masks go unread)."""
    model, ids = llama(dtype=torch.float32), prompt(2)
    step_mask = torch.ones(2, PROMPT + 1, dtype=torch.long)
    step_mask[0, :4] = 0
    c = cache(model, None, None)
    with attention(model, "foldc"), torch.no_grad():
        model(ids[:, :6], attention_mask=torch.ones_like(ids[:, :6]), use_cache=True, **{fhf.CACHE_KWARG: c})
        model(ids[:, 6:], attention_mask=torch.ones_like(ids), use_cache=True, **{fhf.CACHE_KWARG: c})
        with pytest.raises(InputError, match="padding masks are not supported"):
            model(ids[:, :1], attention_mask=step_mask, use_cache=True, **{fhf.CACHE_KWARG: c})


@settings(max_examples=5, deadline=None)
@given(clean=st.integers(1, 3), row=st.integers(0, 1), padded=st.integers(1, PROMPT), seed=st.integers(0, 2**31 - 1))
def test_a_decode_mask_refilled_in_place_is_read_again_at_the_next_forward(clean, row, padded, seed):
    """A serving loop's mask buffer for FoldcStaticCache ([batch, 1, 1, max_cache_len], which transformers passes on
    as it is), refilled in place each step: the decode check read each mask object once, so after a step without
    padding the same buffer with padding went unread at every later step (the padded tokens attended to,
    silently). Each forward reads its mask again now."""
    from foldc.integrations.hf_static import FoldcStaticCache

    model, ids = llama(dtype=torch.float32, seed=seed % 1000), prompt(2, seed=seed)
    c = FoldcStaticCache(model, PROMPT + 8, k="token:4:32", v=None, target="reference")
    mask = torch.zeros(2, 1, 1, PROMPT + 8)   # additive, 0: attend
    with attention(model, "foldc"), torch.no_grad():
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: c})
        for step in range(clean):
            model(ids[:, step:step + 1], attention_mask=mask, use_cache=True, **{fhf.CACHE_KWARG: c})
        mask[row, ..., :padded] = float("-inf")   # the same buffer: row's first tokens are padding now
        with pytest.raises(InputError, match="padding masks are not supported"):
            model(ids[:, :1], attention_mask=mask, use_cache=True, **{fhf.CACHE_KWARG: c})


def test_a_model_that_changes_the_key_after_the_update_is_refused():
    """JetMoe repeats the key cache.update returned before its attention call: the decode step's key is then the
    new token's alone. Refused at the first decode step (it attended over that token only, silently)."""
    jetmoe = pytest.importorskip("transformers.models.jetmoe")
    torch.manual_seed(0)
    config = jetmoe.JetMoeConfig(hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
                                 intermediate_size=128, num_local_experts=2, num_experts_per_tok=2, vocab_size=128,
                                 max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model, ids = jetmoe.JetMoeForCausalLM(config).eval(), prompt(2)
    c = fhf.FoldcCache(model.config, 40, k=None, v=None, target="reference")
    with attention(model, "foldc"), torch.no_grad():
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: c})   # the prompt: its keys are whole, and right
        with pytest.raises(SpecError, match="changes the key after the cache's update"):
            model(ids[:, :1], use_cache=True, **{fhf.CACHE_KWARG: c})


@pytest.mark.parametrize("kind", ["FoldcCache", "PagedFoldcCache", "FoldcStaticCache"])
def test_a_prompts_cache_copied_with_deepcopy_continues_as_the_original(kind):
    """transformers' recipe for reusing a prompt's cache: ``copy.deepcopy`` it before each continuation. The copy of a
    cache whose kernels had run raised TypeError ("cannot pickle 'module' object") from inside the copy (a copy of a
    FoldcStaticCache, unbound from the model, was refused at its first decode step as another model's); now it
    continues exactly as the original does and leaves the original's tokens alone, and what belongs to the model (the
    attention modules the layers checked, a static cache's binding) is not copied."""
    model, ids = llama(), prompt(2)
    c = _caches()[kind](model)
    suffix = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(5))
    with attention(model, "foldc"), torch.no_grad():
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: c})
        model(suffix[:, :1], use_cache=True, **{fhf.CACHE_KWARG: c})   # a decode step: the fused kernel ran
        twin = copy.deepcopy(c)
        assert twin.layers[1].module_checked is c.layers[1].module_checked is model.model.layers[1].self_attn
        runs = []
        for which in (twin, c):   # the copy first: the original must not see its tokens
            runs.append(torch.cat([model(suffix[:, t:t + 1], use_cache=True, **{fhf.CACHE_KWARG: which}).logits
                                   for t in range(1, 4)], dim=1))
    assert int(twin.get_seq_length()) == int(c.get_seq_length()) == PROMPT + 4
    assert torch.equal(runs[0], runs[1])


def _caches() -> dict:
    """Cache kinds of one encoding on an fp16 model under the interpreter, by name."""
    from foldc.integrations.hf_paged import PagedFoldcCache
    from foldc.integrations.hf_static import FoldcStaticCache

    kw = dict(k="token:4:32", v="token:4:32", target="interpret")
    return {"FoldcCache": lambda model: fhf.FoldcCache(model.config, 32, window=3, **kw),
            "PagedFoldcCache": lambda model: PagedFoldcCache(model.config, 32, window=3, **kw),
            "FoldcStaticCache": lambda model: FoldcStaticCache(model, 32, **kw)}


def test_a_prompt_of_another_batch_without_reset_is_refused():
    model = llama(dtype=torch.float32)
    c = cache(model, None, None)
    with attention(model, "foldc"), torch.no_grad():
        model(prompt(2), use_cache=True, **{fhf.CACHE_KWARG: c})
        with pytest.raises(InputError, match=r"holds 2 sequences but the prompt has 3; call cache.reset\(\)"):
            model(prompt(3), use_cache=True, **{fhf.CACHE_KWARG: c})


def test_quantize_model_refuses_a_model_with_no_linear_layers():
    """GPT-2's projections are transformers' Conv1D: quantize_model converted nothing and said nothing."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128,
                                                                n_positions=64)).eval()
    with pytest.raises(SpecError, match="no torch.nn.Linear to quantize .*Conv1D"):
        fhf.quantize_model(gpt2, weight="k-group:4:32")


def test_a_model_without_foldc_attention_is_refused():
    model, ids = llama(dtype=torch.float32), prompt(1)
    with pytest.raises(SpecError, match=r"set_attn_implementation\('foldc'\)"):
        generate(model, cache(model, None, None), ids, impl="sdpa")


def test_beam_search_is_refused():
    model, ids = llama(dtype=torch.float32), prompt(1)
    with attention(model, "foldc"), pytest.raises(NotImplementedError, match="beam search"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, num_beams=2, do_sample=False,
                       **{fhf.CACHE_KWARG: cache(model, "token:4:32", None)})


def test_a_full_cache_names_max_cache_len():
    model, ids = llama(dtype=torch.float32), prompt(1)
    c = fhf.FoldcCache(model.config, PROMPT + 2, k=None, v=None, target="reference")
    with pytest.raises(InputError, match=r"max_cache_len=14\) holds 14 tokens and 1 more do not fit"):
        generate(model, c, ids, new=4)


@pytest.mark.parametrize("make,match", [
    (lambda m: fhf.FoldcCache(m.config, 32, k="token:4", v=None), "must look like 'layout:bits:group_size'"),
    (lambda m: fhf.FoldcCache(m.config, 32, k=4, v=None), "k=4 must be a foldc.Affine"),
    (lambda m: fhf.FoldcCache(m.config, 0, k=None, v=None), "max_cache_len=0 must be a positive integer"),
    (lambda m: fhf.FoldcCache(m.config, 8, k=None, v=None, window=-1), "window=-1 must be an integer >= 0"),
    (lambda m: fhf.FoldcCache(m.config, 8, k=None, v=None, target="cuda"), "target='cuda' is not available"),
    (lambda m: fhf.FoldcCache(Qwen2Config(hidden_size=128, num_attention_heads=4, num_hidden_layers=2,
                                          use_sliding_window=True, sliding_window=16, max_window_layers=1),
                              32, k=None, v=None), r"\['sliding_attention'\] layers"),
])
def test_bad_construction_names_the_value(make, match):
    with pytest.raises(SpecError, match=match):
        make(llama(dtype=torch.float32))


def phimoe(window, seed, dtype=torch.float32):
    """A tiny random PhiMoE: no layer_types, its config's sliding_window applies to every layer, through the mask
    alone (no sliding_window argument reaches the attention)."""
    torch.manual_seed(seed)
    cfg = transformers.PhimoeConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
                                    sliding_window=window, num_local_experts=2, num_experts_per_tok=1,
                                    initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return transformers.PhimoeForCausalLM(cfg).eval().to(dtype)


@pytest.mark.parametrize("kind", ["FoldcCache", "FoldcStaticCache", "PagedFoldcCache", "Mistral"])
@pytest.mark.parametrize("seed", [3, 4])
def test_a_sliding_window_of_every_layer_is_refused_where_max_cache_len_reaches_it(kind, seed):
    """A config without layer_types whose sliding_window applies to every layer (PhiMoE through its mask, Mistral
    through an argument too) was taken: a compiled FoldcStaticCache decode step reads no mask, so past the window it
    attended over every token (PhiMoE, window 6: logits 0.7-4.4 off the default cache's, silently), and eager steps
    refused the window's mask as padding. Refused where the cache is built, naming the window."""
    from foldc.integrations.hf_paged import PagedFoldcCache
    from foldc.integrations.hf_static import FoldcStaticCache

    gen = torch.Generator().manual_seed(seed)
    window = int(torch.randint(4, 12, (), generator=gen))
    model = phimoe(window, seed)
    if kind == "Mistral":
        config = transformers.MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                            num_hidden_layers=2, sliding_window=window)
        make = lambda n: fhf.FoldcCache(config, n, k="token:4:16", v=None)  # noqa: E731
    else:
        cls = {"FoldcCache": fhf.FoldcCache, "FoldcStaticCache": FoldcStaticCache, "PagedFoldcCache": PagedFoldcCache}
        make = lambda n: cls[kind](model if kind == "FoldcStaticCache" else model.config, n,  # noqa: E731
                                   k="token:4:16", v="token:4:16")
    with pytest.raises(SpecError, match=rf"sliding_window={window}: .*max_cache_len={window + 1} holds more.*sdpa"):
        make(window + 1)
    make(window)   # a window the cache never reaches


@torch.no_grad()
def test_a_sliding_window_the_cache_never_reaches_decodes_as_the_default_cache():
    """The window check takes a window max_cache_len stays within (PhiMoE attends as the default cache there) and
    a config whose layer_types say every layer is full attention (Qwen2 with max_window_layers past its layers)."""
    model = phimoe(PROMPT + 6, seed=5)
    ids = prompt(2, seed=6)
    seq, logits = generate(model, fhf.FoldcCache(model.config, PROMPT + 6, k=None, v=None, target="reference"), ids,
                           new=6)
    ref_seq, ref = generate(model, DynamicCache(config=model.config), ids, new=6, impl="sdpa")
    assert torch.equal(seq, ref_seq) and diff(logits, ref)[0] <= FP32_TOL
    qwen = Qwen2Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert qwen.sliding_window == 8 and set(qwen.layer_types) == {"full_attention"}
    fhf.FoldcCache(qwen, 32, k=None, v=None)


@torch.no_grad()
@pytest.mark.parametrize("family, kind", [("Mistral", "FoldcCache"), ("Phi3", "FoldcCache"),
                                          ("Starcoder2", "FoldcCache"), ("Mistral", "FoldcStaticCache"),
                                          ("Starcoder2", "FoldcStaticCache")])
def test_a_model_passing_a_window_the_cache_never_reaches_to_its_attention_decodes_as_the_default_cache(family, kind):
    """Mistral, Phi-3 and Starcoder2 pass their config's sliding_window to the attention function at every layer
    (Mistral-7B-v0.1: 4096, Phi-3-mini-4k: 2047). The caches take a window max_cache_len stays within, but the
    "foldc" attention refused the argument at the first forward (SpecError "sliding_window=...: foldc attention
    supports plain softmax attention over the whole cache only"), so no such model ran: it attends as the default
    cache now, and refuses the argument where the window binds (a call over more keys than the window)."""
    from foldc.integrations.hf_static import FoldcStaticCache

    seed = int(torch.randint(0, 2**16, ()))
    torch.manual_seed(seed)
    window = PROMPT + 6
    cfg = getattr(transformers, f"{family}Config")(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=128, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
        eos_token_id=None, sliding_window=window)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    ids = prompt(2, seed=seed)
    make = FoldcStaticCache if kind == "FoldcStaticCache" else fhf.FoldcCache
    foldc_cache = make(model if kind == "FoldcStaticCache" else model.config, window, k=None, v=None,
                       target="reference")
    seq, logits = generate(model, foldc_cache, ids, new=6)
    ref_seq, ref = generate(model, DynamicCache(config=model.config), ids, new=6, impl="sdpa")
    assert torch.equal(seq, ref_seq) and diff(logits, ref)[0] <= FP32_TOL, f"seed {seed}"
    with attention(model, "foldc"), pytest.raises(SpecError, match=rf"sliding_window={window}: "):
        model(prompt(1, seed=seed + 1).repeat(1, 2))   # 2 * PROMPT keys: past the window, without a foldc cache


@torch.no_grad()
@pytest.mark.parametrize("kind", ["FoldcCache", "PagedFoldcCache"])
def test_an_alibi_bias_in_the_mask_is_refused_naming_the_bias_not_padding(kind):
    """Falcon with alibi=True adds its position bias to the attention mask. A foldc cache refused that mask as
    padding ("pass batch rows of equal length without padding"), which no caller can fix: an unpadded prompt got it
    too. It is a SpecError naming the bias and the fix now, and a padded mask is still refused as padding."""
    from foldc.integrations.hf_paged import PagedFoldcCache

    seed = int(torch.randint(0, 2**16, ()))
    torch.manual_seed(seed)
    cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                                    alibi=True, new_decoder_architecture=False, multi_query=True, pad_token_id=0,
                                    bos_token_id=1, eos_token_id=None)
    dtype = torch.float16 if kind == "PagedFoldcCache" else torch.float32
    model = transformers.FalconForCausalLM(cfg).eval().to(dtype)
    target = "interpret" if kind == "PagedFoldcCache" else "reference"
    make = PagedFoldcCache if kind == "PagedFoldcCache" else fhf.FoldcCache
    ids = prompt(2, seed=seed)
    with attention(model, "foldc"):
        with pytest.raises(SpecError, match=r"additive bias .*ALiBi.*attn_implementation='sdpa'"):
            model(ids, use_cache=True, **{fhf.CACHE_KWARG: make(model.config, 32, k="token:4:16", v="token:4:16",
                                                                target=target)})
    model = transformers.FalconForCausalLM(transformers.FalconConfig(**{**cfg.to_dict(), "alibi": False}))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with attention(model.eval().to(dtype), "foldc"), pytest.raises(InputError, match="padding masks"):
        model(ids, attention_mask=mask, use_cache=True,
              **{fhf.CACHE_KWARG: make(model.config, 32, k="token:4:16", v="token:4:16", target=target)})


@torch.no_grad()
def test_a_sparse_attentions_selected_keys_are_refused_not_dropped():
    """DeepSeek-V3.2's indexer picks each query's top-k keys; for attention implementations other than eager and SDPA
    the model passes them as ``indices`` and leaves them out of the mask. The "foldc" attention (here over the
    default cache, its SDPA path) dropped the argument and attended over every key, silently (logits 0.8-1.2 off
    of the max). Refused naming the argument."""
    seed = int(torch.randint(0, 2**16, ()))
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV32Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, head_dim=16, index_head_dim=32, index_n_heads=2, index_topk=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = transformers.DeepseekV32ForCausalLM(cfg).eval()
    ids = prompt(1, seed=seed)   # PROMPT tokens: past index_topk, so the indexer drops keys
    with attention(model, "foldc"), pytest.raises(SpecError, match=r"indices=<tensor .*attn_implementation='sdpa'"):
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: DynamicCache(config=model.config)})


@torch.no_grad()
@pytest.mark.parametrize("family", ["Gemma2", "GptOss"])
def test_soft_capping_and_sinks_are_refused_naming_an_implementation_the_model_takes(family):
    """Gemma2's soft-capping and gpt-oss's sinks are refused by the "foldc" attention, which told the caller to run
    the model with attn_implementation='sdpa': transformers refuses SDPA for both models (its SDPA drops neither).
    The error names 'eager' now, and the model runs there."""
    seed = int(torch.randint(0, 2**16, ()))
    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=None,
              layer_types=["full_attention"] * 2)
    if family == "GptOss":
        kw.update(num_local_experts=2, num_experts_per_tok=1)
    model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**kw)).eval()
    ids = prompt(1, seed=seed)
    with attention(model, "foldc"), pytest.raises(SpecError, match=r"(softcap|s_aux)=.*attn_implementation='eager'"):
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: fhf.FoldcCache(model.config, 32, k=None, v=None,
                                                                      target="reference")})
    with attention(model, "eager"):
        assert torch.isfinite(model(ids).logits).all()


def test_the_interpreter_needs_a_float16_model():
    model, ids = llama(dtype=torch.float32), prompt(1)
    with pytest.raises(SpecError, match=r"float16 on the CPU only, but the model runs in torch.float32"):
        generate(model, fhf.FoldcCache(model.config, 32, k=None, v=None, target="auto"), ids)


# ---- paged storage -------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning",  # an empty body part
                            "ignore:divide by zero encountered in log2:RuntimeWarning")
@pytest.mark.parametrize("head_dim, k, v, sink, window", [(32, "token:4:16", "channel:4:16", 1, 4)])
def test_paged_cache_holds_the_bits_of_the_contiguous_cache_and_decodes_exactly(head_dim, k, v, sink, window):
    """PagedFoldcCache: every decode step matches float64 attention over its own dequantized tokens,
    and replaying the same tokens leaves the same bits in every layer as FoldcCache."""
    from foldc.integrations.hf_paged import PagedFoldcCache

    model, ids = llama(head_dim), prompt(2)
    paged = PagedFoldcCache(model.config, PROMPT + NEW + 8, k=k, v=v, sink=sink, window=window, target="interpret")
    with checked_decode() as errors:
        seq, logits = generate(model, paged, ids)
    assert len(errors) == 2 * (NEW - 1) and max(errors) < ATTN_TOL, f"decode attention errors up to {max(errors):.2e}"
    assert paged.paged_cache.body_len(PROMPT + NEW - 1) > 0
    contiguous = cache(model, k, v, sink=sink, window=window)
    paged.reset()
    replay(model, paged, seq)
    replay(model, contiguous, seq)
    for view, layer in zip(paged.layer_caches, contiguous.layer_caches):
        assert view.num_tokens == layer.num_tokens == PROMPT + NEW - 1
        for got, want in zip(view.dequantized(), layer.dequantized()):
            assert torch.equal(got, want)


def test_paged_cache_refuses_a_plain_operand_and_a_float32_model():
    from foldc.integrations.hf_paged import PagedFoldcCache

    model = llama(dtype=torch.float32)
    with pytest.raises(SpecError, match=r"PagedFoldcCache quantizes both K and V"):
        PagedFoldcCache(model.config, 32, k="token:4:32", v=None)
    paged = PagedFoldcCache(model.config, 32, k="token:4:32", v="token:4:32", target="reference")
    with pytest.raises(SpecError, match=r"holds float16 or bfloat16 models; this one runs in torch.float32"):
        generate(model, paged, prompt(1))


def test_paged_cache_on_another_device_than_a_layers_states_names_both_and_the_fix():
    """PagedFoldcCache keeps every layer's pages in one PagedKVCache, built on the first layer's device. A later
    layer's states on another device (a model split by device_map), or a model moved after the first forward, were
    refused by the paged cache's "k_new is on meta but the cache is on cpu; move it there" (the model's states to
    the pages: not the user's to move), and a prefill raised from inside torch.cat. Refused now naming both devices
    and the fix (one device, FoldcCache for a split model, reset for a moved one); the cache goes on as it was.
    The meta device stands in for a second one (the check compares devices; no value is read)."""
    from foldc.integrations.hf_paged import PagedFoldcCache

    model = llama()
    paged = PagedFoldcCache(model.config, 32, k="token:4:32", v="token:4:32", target="reference")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    k, v = (torch.randn(1, 2, 5, 32, generator=gen).half() for _ in range(2))
    fix = (r"on meta but this PagedFoldcCache's pages are on cpu, where its first forward built them: .* needs "
           r"FoldcCache, which builds each layer's cache on that layer's device\); .* call cache\.reset\(\)")
    with attention(model, "foldc"):
        paged.update(k, v, 0)
        with pytest.raises(InputError, match=rf"layer 1's key and value states are {fix}"):
            paged.update(k.to("meta"), v.to("meta"), 1)   # a model split across devices
        assert not paged.layers[1].is_initialized
        # layer 0 holds the failed forward's tokens, layer 1 none (tests/integrations/test_hf_failed_forward.py)
        with pytest.raises(InputError, match="no longer hold the same tokens"):
            paged.update(k, v, 0)
        paged.reset()
        paged.update(k, v, 0)
        paged.update(k, v, 1)
        for new in (1, 5):   # a decode step and a prefill, the model moved since: refused before any change
            with pytest.raises(InputError, match=rf"layer 0's key and value states are {fix}"):
                paged.update(k[:, :, :new].to("meta"), v[:, :, :new].to("meta"), 0)
        paged.update(k[:, :, :1], v[:, :, :1], 0)
        paged.update(k[:, :, :1], v[:, :, :1], 1)
    assert paged.paged_cache.num_tokens(0) == paged.paged_cache.num_tokens(1) == [6]
    got_k, got_v, _ = paged.paged_cache.dequantized(1)
    want_k, want_v, _ = paged.paged_cache.dequantized(0)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_foldc_cache_of_a_model_moved_since_its_first_forward_names_both_devices_and_the_fix():
    """FoldcCache builds each layer's cache on the device of that layer's first forward. A model moved since was told
    "k_new is on meta but the cache is on cpu; move it there" (the model's states to the cache: not the user's to
    move) at a decode step, and a prefill raised from inside torch.cat. Refused now naming both devices and the fix
    (reset or a new cache); the layer goes on as it was. The meta device stands in for a second one (the check
    compares devices; no value is read)."""
    model = llama()
    c = fhf.FoldcCache(model.config, 32, k="token:4:32", v="token:4:32", target="reference")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    k, v = (torch.randn(1, 2, 5, 32, generator=gen).half() for _ in range(2))
    fix = r"states are on meta but its FoldcCache layer was built on cpu by the first forward: .* cache\.reset\(\)"
    with attention(model, "foldc"):
        c.update(k, v, 0)
        for new in (1, 3):   # a decode step and a prefill, the model moved since
            with pytest.raises(InputError, match=fix):
                c.update(k[:, :, :new].to("meta"), v[:, :, :new].to("meta"), 0)
        c.update(k[:, :, :1], v[:, :, :1], 0)
    assert c.get_seq_length(0) == 6


@settings(max_examples=25, deadline=None)
@given(page_size=st.one_of(st.integers(-16, 160), st.sampled_from(["64", 64.0, True])),
       v=st.sampled_from(["token:4:32", "channel:4:32", "channel:2:16"]))
def test_paged_cache_checks_its_page_size_where_it_is_built(page_size, v):
    """A page_size the paged decode refuses (0, text, 24 tokens, not whole channel-wise groups) was taken by
    PagedFoldcCache and refused at the first forward (0 and text as a ZeroDivisionError and a TypeError). It is refused
    where the cache is built now, with the decode wrapper's own message; a page_size it takes builds."""
    from foldc.integrations.hf_paged import PagedFoldcCache
    from foldc.serving import PagedDecodeWrapper

    config = llama().config
    spec = PagedFoldcCache(config, 32, k="token:4:32", v=v, target="reference").spec
    try:
        PagedDecodeWrapper(spec, page_size, max_seq_len=32, target="reference")
    except SpecError as e:
        with pytest.raises(SpecError, match=re.escape(str(e))):
            PagedFoldcCache(config, 32, k="token:4:32", v=v, target="reference", page_size=page_size)
    else:
        assert PagedFoldcCache(config, 32, k="token:4:32", v=v, target="reference", page_size=page_size).paged_cache \
            is None


@pytest.mark.parametrize("k,v,page", [("token:4:32", "token:4:32", 64), ("token:2:128", "channel:2:128", 128),
                                      ("channel:4:16", "token:4:64", 64)])
def test_paged_cache_pages_hold_the_register_operand_kernels_tiles(k, v, page):
    """PagedFoldcCache's default page holds whole 64-token tiles and whole channel-wise groups, so that on sm_90 its
    paged decode runs the register-operand kernel (pages of 16 tokens ran the generated Triton kernel)."""
    from foldc.integrations.hf_paged import PagedFoldcCache
    from foldc.serving.paged import register_operand_kernel

    model = llama(head_dim=128)
    paged = PagedFoldcCache(model.config, 32, k=k, v=v, target="reference")
    assert paged.shared["page_size"] == page
    assert register_operand_kernel(paged.spec, page, "sm_90") is not None


def test_quantize_model_swaps_every_linear_but_the_head_and_matches_its_dequantized_twin():
    """quantize_model: each nn.Linear (lm_head skipped) becomes a FoldLinear whose plan was proved;
    the float32 model's logits equal, to float32 rounding, those of a copy whose linears hold the
    dequantized weights; a weight encoding a layer cannot take is refused before anything changes."""
    import copy

    from foldc.nn import FoldLinear

    model = llama(dtype=torch.float32, seed=4)
    twin = copy.deepcopy(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with pytest.raises(SpecError, match="does not divide"):
        fhf.quantize_model(model, weight="k-group:4:48")
    assert [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)] == linears   # untouched
    assert fhf.quantize_model(model, weight="k-group:4:32") is model
    swapped = {n: m for n, m in model.named_modules() if isinstance(m, FoldLinear)}
    assert set(swapped) == {n for n in linears if n != "lm_head"} and isinstance(model.lm_head, torch.nn.Linear)
    for name, layer in swapped.items():
        assert layer.plan.folds
        twin.get_submodule(name).weight.data = layer.weight.dequantize(torch.float32)[0, 0]
    ids = prompt(2)
    with torch.no_grad():
        got, want = model(ids).logits, twin(ids).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_weight_and_kv_folds_end_to_end_equal_their_dequantized_twin():
    """W4 + KV4 in one model, every fold planned and proved by foldc: greedy generate with quantized
    linears (FoldLinear, the generated GEMM kernel under the interpreter) and a FoldcCache; every
    decode step's attention within the bar of float64 over its dequantized cache, and the logits,
    teacher-forced, within DEQUANT_TOL of a twin whose linears hold the dequantized weights and whose
    cache dequantizes before attending."""
    import copy

    from foldc.nn import FoldLinear

    model, ids = llama(), prompt(2)
    fhf.quantize_model(model, weight="k-group:4:32")
    twin = copy.deepcopy(model)
    for name, layer in list(twin.named_modules()):
        if isinstance(layer, FoldLinear):
            plain = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            plain.weight.data = layer.weight.dequantize(torch.float32)[0, 0].half()
            if layer.bias is not None:
                plain.bias.data = layer.bias.half()
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent), child, plain.half())
    assert not any(isinstance(m, FoldLinear) for m in twin.modules())
    with checked_decode() as errors:
        seq, logits = generate(model, cache(model, "token:4:32", "token:4:32"), ids)
    assert len(errors) == 2 * (NEW - 1) and max(errors) < ATTN_TOL
    worst, _ = diff(logits, replay(twin, dequantized(twin, "token:4:32", "token:4:32"), seq))
    assert worst < DEQUANT_TOL, f"logits differ from the dequantized twin by {worst:.2e} of max"


def test_quantize_model_refuses_a_tied_output_projection():
    """skip=() with tied embeddings: lm_head's weight is the embedding's parameter; replacing it untied them and
    transformers' tie_weights() then raised a KeyError."""
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                         tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(SpecError, match="lm_head's weight is tied to model.embed_tokens's"):
        fhf.quantize_model(model, weight="k-group:4:32", skip=())
    assert isinstance(model.lm_head, torch.nn.Linear)   # nothing replaced


@pytest.mark.parametrize("storage, match", [
    (lambda w: (w * 127 / w.abs().max()).round().to(torch.int8), r"weight dtype=torch\.int8"),
    (lambda w: w.reshape(-1, 1)[: w.numel() // 2], r"weight shape=\(4096, 1\) but the linear is 64 x 128"),
])
def test_quantize_model_refuses_a_linear_holding_another_quantizers_storage_before_any_change(storage, match):
    """A linear whose weight another quantizer replaced by its storage (bitsandbytes' int8 codes, packed uint8 of
    shape [n * k / 2, 1]): its int8 codes were quantized as if they were the weights (silently), and a packed shape
    raised a SpecError about k=1 after every layer before it had been replaced. Refused by name now, the model
    unchanged."""
    from foldc.nn import FoldLinear

    model = llama(dtype=torch.float32, seed=int(torch.randint(0, 2**31 - 1, ())))
    down = model.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(storage(down.weight.detach()), requires_grad=False)
    with pytest.raises(InputError, match=rf"^model\.layers\.1\.mlp\.down_proj's {match}.*the model is unchanged"):
        fhf.quantize_model(model, weight="k-group:4:32")
    assert not any(isinstance(m, FoldLinear) for m in model.modules())


def test_quantize_model_of_a_linear_itself_is_refused_naming_from_linear():
    """quantize_model(nn.Linear) replaces linears inside a model, so it set the FoldLinear as an attribute named ''
    of the linear and returned the float linear unquantized, silently; something that is no module raised an
    AttributeError. Both are an InputTypeError now, the first naming FoldLinear.from_linear."""
    from foldc.errors import InputTypeError

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    linear = torch.nn.Linear(64, 16)
    before = linear.weight.detach().clone()
    with pytest.raises(InputTypeError, match=r"model is itself an nn\.Linear.*FoldLinear\.from_linear"):
        fhf.quantize_model(linear, weight="k-group:4:32")
    assert not hasattr(linear, "") and torch.equal(linear.weight, before)
    with pytest.raises(InputTypeError, match="model must be a torch.nn.Module, got str"):
        fhf.quantize_model("model", weight="k-group:4:32")


class _SharedStack(torch.nn.Module):
    """One nn.Linear applied three times, registered under three names (a weight-shared stack)."""

    def __init__(self, features: int):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(features, features)] * 3)
        self.out = torch.nn.Linear(features, 32)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def test_quantize_model_replaces_a_linear_registered_under_several_names_at_every_one():
    """named_modules() gives a module once, under its first name: layers.0 became a FoldLinear, layers.1 and layers.2
    kept the float linear (a third of the shared layer's uses quantized, silently). One FoldLinear at every name now,
    the model equal to its twin over the dequantized weights; a skip naming some of its names but not all is refused."""
    from foldc.nn import FoldLinear

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    model = _SharedStack(64)
    with pytest.raises(SpecError, match=r"layers\.0 is also registered as layers\.1, layers\.2.*skip"):
        fhf.quantize_model(model, weight="k-group:4:32", skip=("1",))
    assert not any(isinstance(m, FoldLinear) for m in model.modules())
    fhf.quantize_model(model, weight="k-group:4:32", skip=())
    layer = model.layers[0]
    assert isinstance(layer, FoldLinear) and all(m is layer for m in model.layers)
    w = layer.weight.dequantize(torch.float64)[0, 0]
    x = torch.randn(5, 64)
    want = x.double()
    for _ in range(3):
        want = torch.tanh(want @ w.T + layer.bias.double())
    ow = model.out.weight.dequantize(torch.float64)[0, 0]
    want = want @ ow.T + model.out.bias.double()
    with torch.no_grad():
        assert torch.allclose(model(x).double(), want, rtol=0, atol=1e-5)


class _WithHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.lm_head = torch.nn.Linear(64, 16)


def test_quantize_model_takes_skip_as_any_iterable_of_names_and_refuses_other_entries():
    """skip as a generator was used up by the first module it was checked against: lm_head was quantized (silently);
    an entry that is no string raised a TypeError from '.' + entry. The names are read once now, anything else an
    InputTypeError naming it."""
    from foldc.errors import InputTypeError
    from foldc.nn import FoldLinear

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    model = _WithHead()
    fhf.quantize_model(model, weight="k-group:4:32", skip=(name for name in ["lm_head"]))
    assert isinstance(model.fc, FoldLinear) and type(model.lm_head) is torch.nn.Linear
    model = _WithHead()
    with pytest.raises(InputTypeError, match=r"skip holds 0 \(int\).*names of modules"):
        fhf.quantize_model(model, weight="k-group:4:32", skip=("lm_head", 0))
    assert not any(isinstance(m, FoldLinear) for m in model.modules())


@pytest.mark.parametrize("kind", ["FoldcCache", "PagedFoldcCache", "FoldcStaticCache"])
@pytest.mark.parametrize("method, args", [("reorder_cache", (torch.tensor([1, 0]),)), ("batch_select_indices",
                                          (torch.tensor([1]),)), ("batch_repeat_interleave", (2,)), ("crop", (-1,))])
@torch.no_grad()
def test_cache_methods_it_cannot_run_are_refused_as_fold_errors_naming_the_method(kind, method, args):
    """reorder_cache (beam search), batch_select_indices, batch_repeat_interleave and crop (assisted decoding) on a
    cache holding tokens raised a builtin NotImplementedError, which `except foldc.FoldError` (every foldc error, by
    docs/serving.md) let through, and named no method. Now a FoldError that is still a NotImplementedError, naming
    the method; the cache keeps its tokens."""
    from foldc.errors import FoldError
    from foldc.integrations.hf_paged import PagedFoldcCache
    from foldc.integrations.hf_static import FoldcStaticCache

    model, ids = llama(dtype=torch.float16 if kind == "PagedFoldcCache" else torch.float32), prompt(2)
    cls = {"FoldcCache": fhf.FoldcCache, "PagedFoldcCache": PagedFoldcCache, "FoldcStaticCache": FoldcStaticCache}[kind]
    make = lambda: cls(model if cls is FoldcStaticCache else model.config, 32, k="token:4:32", v="token:4:32",  # noqa: E731
                       target="reference")
    c = make()
    with attention(model, "foldc"):
        model(ids, use_cache=True, **{fhf.CACHE_KWARG: c})
    with pytest.raises(FoldError, match=re.escape(method)) as err:
        getattr(c, method)(*args)
    assert isinstance(err.value, NotImplementedError)
    assert int(c.get_seq_length()) == PROMPT
    with attention(model, "foldc"), pytest.raises(FoldError, match="reorder_cache"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, num_beams=2, do_sample=False,
                       **{fhf.CACHE_KWARG: make()})


def gemma3(window, seed=5):
    """A tiny random Gemma3 text model: every other layer a sliding-window layer (its layer_types)."""
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                        sliding_window=window, layer_types=["sliding_attention", "full_attention"] * 2,
                                        max_position_embeddings=256, initializer_range=0.1)
    return transformers.Gemma3ForCausalLM(cfg).eval().to(torch.float32)


@pytest.mark.parametrize("seed", [5, 6])
def test_sliding_layers_whose_window_max_cache_len_never_reaches_are_full_attention(seed):
    """Gemma 3's sliding layers with a window of at least max_cache_len hide no token: FoldcCache takes them (it
    refused every sliding layer) and decodes what the default cache decodes; a window max_cache_len passes is still
    refused, naming the max_cache_len that fits."""
    model = gemma3(window=64, seed=seed)
    ids = torch.randint(2, 128, (2, PROMPT), generator=torch.Generator().manual_seed(seed))
    c = fhf.FoldcCache(model.config, PROMPT + NEW + 8, k=None, v=None, target="reference")
    seq, logits = generate(model, c, ids)
    ref_seq, ref_logits = generate(model, DynamicCache(config=model.config), ids, impl="sdpa")
    worst, _ = diff(logits, ref_logits)
    assert torch.equal(seq, ref_seq) and worst < 1e-4, worst
    with pytest.raises(SpecError, match=r"max_cache_len <= 8 never reaches the window"):
        fhf.FoldcCache(gemma3(window=8).config, PROMPT + NEW + 8, k=None, v=None, target="reference")
