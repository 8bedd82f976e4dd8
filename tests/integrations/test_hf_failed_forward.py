"""A forward through a foldc cache that fails partway: its layers are out of step, and the cache says so.

Each layer appends the forward's tokens in its update, before its attention runs. A forward refused at the first
layer's attention (a padded mask, the most common refusal) left that layer holding one token more than the others;
the next forward without the padding then ran, its first layer attending over the refused step's token, silently.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
fhf = pytest.importorskip("foldc.integrations.hf")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from foldc.errors import InputError  # noqa: E402

PROMPT, MAX = 10, 24


def _llama(dtype, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=64,
                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval().to(dtype)
    model.set_attn_implementation("foldc")
    return model


def _make(kind, model):
    from foldc.integrations.hf_paged import PagedFoldcCache
    from foldc.integrations.hf_static import FoldcStaticCache

    if kind == "FoldcStaticCache":
        return FoldcStaticCache(model, MAX, k="token:4:32", v="token:4:32", target="reference")
    cls = PagedFoldcCache if kind == "PagedFoldcCache" else fhf.FoldcCache
    return cls(model.config, MAX, k="token:4:32", v="token:4:32", target="reference")


def _padded_step_mask(kind, row, hidden):
    """A decode step's mask hiding ``row``'s first ``hidden`` tokens (as a serving loop passes it to each cache)."""
    if kind == "FoldcStaticCache":   # transformers passes a 4-D mask on as it is
        mask = torch.zeros(2, 1, 1, MAX)
        mask[row, ..., :hidden] = float("-inf")
        return mask
    mask = torch.ones(2, PROMPT + 1, dtype=torch.long)
    mask[row, :hidden] = 0
    return mask


def _run(model, cache, ids, **kw):
    return model(ids, use_cache=True, **kw, **{fhf.CACHE_KWARG: cache}).logits.float()


@pytest.mark.parametrize("kind", ["FoldcCache", "PagedFoldcCache", "FoldcStaticCache"])
@pytest.mark.parametrize("case", range(2))
@torch.no_grad()
def test_a_forward_after_one_refused_at_its_first_attention_is_refused_until_reset(kind, case):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    model = _llama(torch.float16 if kind == "PagedFoldcCache" else torch.float32, seed % 1000)
    ids = torch.randint(3, 128, (2, PROMPT), generator=gen)
    step = torch.randint(3, 128, (2, 1), generator=gen)
    row, hidden = int(torch.randint(0, 2, (), generator=gen)), int(torch.randint(1, PROMPT, (), generator=gen))
    c, fresh = _make(kind, model), _make(kind, model)
    _run(model, c, ids)
    with pytest.raises(InputError, match="padding masks are not supported"):
        _run(model, c, step, attention_mask=_padded_step_mask(kind, row, hidden))
    # the first layer holds the refused step's token, the second does not: the next step is refused by name
    with pytest.raises(InputError, match=r"no longer hold the same tokens.*padding masks.*cache\.reset\(\)"):
        _run(model, c, step)
    with pytest.raises(InputError, match="no longer hold the same tokens"):
        _run(model, c, ids)   # a prompt too
    c.reset()
    got = [_run(model, c, ids), _run(model, c, step)]
    want = [_run(model, fresh, ids), _run(model, fresh, step)]
    assert all(torch.equal(g, w) for g, w in zip(got, want)), f"seed {seed}"


@torch.no_grad()
def test_an_update_failing_past_the_first_layer_marks_the_cache_and_one_refused_at_the_first_does_not(monkeypatch):
    """An update that fails at a later layer (its states on another device than its cache, for a model moved or
    split since the first forward) comes after the first layers appended that forward's tokens: the cache refuses
    the next forward. The first layer's own refusals (a full cache, a prompt of another batch) change nothing: the
    cache goes on."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    model = _llama(torch.float32, seed % 1000)
    ids = torch.randint(3, 128, (2, PROMPT), generator=gen)
    step = torch.randint(3, 128, (2, 1), generator=gen)
    c, fresh = _make("FoldcCache", model), _make("FoldcCache", model)
    want = [_run(model, fresh, ids), _run(model, fresh, step)]
    assert torch.equal(_run(model, c, ids), want[0])
    with pytest.raises(InputError, match="holds 2 sequences but the prompt has 3"):
        _run(model, c, torch.randint(3, 128, (3, 4), generator=gen))
    assert torch.equal(_run(model, c, step), want[1]) and c.get_seq_length() == PROMPT + 1

    def moved(*args, **kwargs):
        raise InputError("this layer's key and value states are on meta but its FoldcCache layer was built on cpu")

    monkeypatch.setattr(c.layers[1], "update", moved)
    with pytest.raises(InputError, match="states are on meta"):
        _run(model, c, step)
    monkeypatch.undo()
    with pytest.raises(InputError, match=r"no longer hold the same tokens.*states are on meta"):
        _run(model, c, step)
