"""The "foldc" attention function outside a foldc cache: what a model's attention call asks of it.

`model.set_attn_implementation("foldc")` on a vision-language model sets every sub-model's attention, its vision
tower's too; an encoder's attention is not causal and says so (``module.is_causal`` or ``is_causal=False``). Arguments
that change the scores (T5's relative ``position_bias``, per-token ``sinks``) are refused, not dropped.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
fhf = pytest.importorskip("foldc.integrations.hf")

from foldc.errors import SpecError  # noqa: E402


class _Module(torch.nn.Module):
    def __init__(self, is_causal=None):
        super().__init__()
        if is_causal is not None:
            self.is_causal = is_causal


@settings(max_examples=20, deadline=None)
@given(q_len=st.integers(2, 9), extra=st.integers(0, 5), groups=st.sampled_from([1, 2, 4]),
       how=st.sampled_from(["module", "call", "call overrides module"]), seed=st.integers(0, 2**31 - 1))
def test_a_call_that_is_not_causal_attends_to_every_key(q_len, extra, groups, how, seed):
    """Without a mask, foldc attention masked every call causally: an encoder's queries (is_causal=False on the module
    or the call) lost every key after their own position, silently. It attends as SDPA does now."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim, kv_len = 2, 16, q_len + extra
    q = torch.randn(2, kv_heads * groups, q_len, head_dim, generator=gen)
    k, v = (torch.randn(2, kv_heads, kv_len, head_dim, generator=gen) for _ in range(2))
    module, kwargs = {"module": (_Module(False), {}), "call": (_Module(), {"is_causal": False}),
                      "call overrides module": (_Module(True), {"is_causal": False})}[how]
    out, weights = fhf.foldc_attention(module, q, k, v, None, scaling=0.3, **kwargs)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), scale=0.3)
    assert weights is None and torch.allclose(out, want.transpose(1, 2), atol=1e-6, rtol=1e-5)
    # a causal call (the module's default, or is_causal=True over a module that is not) keeps the causal mask, as
    # transformers' SDPA aligns it without a mask: from the first key (a prompt into an empty StaticCache's slots)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = fhf.foldc_attention(_Module(False), q, k, v, None, scaling=0.3, is_causal=True)
    sdpa_module = _Module(False)
    sdpa_module.num_key_value_groups = groups
    want, _ = sdpa_attention_forward(sdpa_module, q, k, v, None, scaling=0.3, is_causal=True)
    assert torch.allclose(out, want, atol=1e-6, rtol=1e-5)


def test_a_vision_tower_through_foldc_attention_matches_sdpa():
    """A SigLIP vision tower (what a VLM's set_attn_implementation("foldc") reaches) gave outputs off by units."""
    torch.manual_seed(0)
    config = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=32, patch_size=8)
    model = transformers.SiglipVisionModel(config).eval()
    pixels = torch.randn(2, 3, 32, 32)
    out = {}
    for impl in ("sdpa", "foldc"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model(pixel_values=pixels).last_hidden_state
    assert torch.allclose(out["foldc"], out["sdpa"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["position_bias", "sinks"])
def test_a_score_bias_or_sinks_argument_is_refused_naming_it(name):
    """An argument that changes the scores was dropped silently (T5's relative position bias, Inkling2's per-token
    sinks): refused now, naming it by its shape and the fix."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
    extra = {name: torch.randn(1, 2, 5, 5 if name == "position_bias" else 1, generator=gen)}
    fix = "sdpa" if name == "position_bias" else "eager"   # (transformers' SDPA takes no sinks)
    with pytest.raises(SpecError, match=rf"{name}=<tensor \(1, 2, 5, \d\)>.*attn_implementation='{fix}'"):
        fhf.foldc_attention(_Module(), q, k, v, None, **extra)


def test_a_t5_encoder_through_foldc_attention_is_refused():
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=128)
    model = transformers.T5EncoderModel(config).eval()
    model.set_attn_implementation("foldc")
    with torch.no_grad(), pytest.raises(SpecError, match="position_bias"):
        model(torch.randint(3, 128, (2, 10)))
