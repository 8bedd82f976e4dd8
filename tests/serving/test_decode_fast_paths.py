"""`QuantizedKVCache`'s decode-step fast paths (`append` of one token, `attention` over the body alone) with
stand-in kernels on the CPU: once the whole path has bound a step's launches, the next steps of that shape hand
the same launches the same addresses and offsets without the whole path's checks, and every call the whole path
would refuse or treat otherwise still goes to it. The real kernels: tests/serving/test_paged_gpu.py (H200)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import foldc
from foldc.errors import InputError
from foldc.serving import QuantizedKVCache
from foldc.serving import cache as cache_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from _kernel_cases import LaunchRecorder  # noqa: E402
from test_cache import _KernelStandIn, _tokens  # noqa: E402


@pytest.fixture
def native(monkeypatch):
    """``native(sink=0, window=0)``: a cache of one token-wise encoding whose appends and body attention launch
    stand-in kernels as on a GPU, and the (append, decode) recorders."""
    from foldc.backends.gluon.launch import GluonAttention
    from foldc.serving import append as append_module

    class Resident(GluonAttention):
        def resident(self, *a):
            return 12

    kernels = {}
    monkeypatch.setattr(append_module, "_fast", lambda name, interpret: kernels.setdefault(name, _KernelStandIn()))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def make(sink=0, window=0):
        enc = foldc.Affine(4, "token", 32)
        spec = foldc.AttentionSpec(8, 2, 64, enc, enc)
        cache = QuantizedKVCache(spec, 1, 64, sink=sink, window=window, target="interpret")
        cache._append_mode = "native"
        body = Resident(spec)
        decode, merge = LaunchRecorder(), LaunchRecorder()
        monkeypatch.setattr(body, "_launchers", lambda: (decode, merge))
        cache._body_attention = body
        return cache, kernels, decode
    return make


def _counting(monkeypatch, name, owner=cache_module):
    """The calls of ``owner.name`` from now on (the whole path's first step: `_raise_if_flagged`)."""
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_fast_steps_launch_what_the_whole_path_launches(native, monkeypatch):
    """From the step after the bind, appends and attention skip the whole path's checks (none of its checks is
    called) and the bound launches get the new tokens' and query's addresses, the storage's addresses the whole
    path made and the step's offset and token count; the outputs are new tensors each step."""
    cache, kernels, decode = native()
    gen = torch.Generator().manual_seed(1)
    cache.append(*_tokens(cache, 10, gen))
    q = torch.randn(1, 8, 64, generator=gen).half()
    for _ in range(3):   # keyed, keyed, bound: the whole path each time
        cache.append(*_tokens(cache, 1, gen))
        cache.attention(q, sm_scale=0.125)
    assert cache._token_write is not None and cache._attend is not None
    (bound,), = cache._append_bindings.bound()
    whole_call = bound.calls[-1][0]
    checks, scales = _counting(monkeypatch, "check_new_tokens"), _counting(monkeypatch, "check_sm_scale")
    whole = _counting(monkeypatch, "_raise_if_flagged", cache)
    outs = []
    for step in range(4):
        k, v = _tokens(cache, 1, gen)
        q = torch.randn(1, 8, 64, generator=gen).half()
        cache.append(k, v)
        outs.append(cache.attention(q, sm_scale=0.125))
        addresses, values = bound.calls[-1]
        assert addresses == (k.data_ptr(), *whole_call[1:9], v.data_ptr(), *whole_call[10:])
        assert values == (13 + step,)
        assert decode.bound[0].values[-1] == (14 + step,) and decode.bound[0].calls[-1][0] == q.data_ptr()
    assert checks == [] and scales == [] and whole == [] and cache.body_tokens == 17
    assert len({o.data_ptr() for o in outs}) == len(outs) and all(o.shape == (1, 8, 64) for o in outs)
    assert len(kernels["token"].launches) == 3   # the prefill and two steps keyed; none since the bind


def _bound_cache(native, gen, **kw):
    cache, kernels, decode = native(**kw)
    cache.append(*_tokens(cache, 10, gen))
    q = torch.randn(1, 8, 64, generator=gen).half()
    for _ in range(3):
        cache.append(*_tokens(cache, 1, gen))
        cache.attention(q, sm_scale=0.125)
    return cache, q


@pytest.mark.parametrize("change", ["k dtype", "v batch", "two tokens", "flagged", "full", "k subclass",
                                    "strided v"])
def test_an_append_the_fast_path_cannot_vouch_for_takes_the_whole_path(native, change, monkeypatch):
    """Each of these goes to the whole path, which refuses it by name or writes it as it always did."""
    gen = torch.Generator().manual_seed(2)
    cache, _ = _bound_cache(native, gen)
    checks = _counting(monkeypatch, "_raise_if_flagged", cache)
    k, v = _tokens(cache, 1, gen)
    before = cache.body_tokens
    if change == "k dtype":
        with pytest.raises(InputError, match="dtype"):
            cache.append(k.float(), v)
    elif change == "v batch":
        with pytest.raises(InputError, match="shape"):
            cache.append(k, torch.cat([v, v]))
    elif change == "two tokens":
        cache.append(*_tokens(cache, 2, gen))
        assert cache.body_tokens == before + 2
    elif change == "flagged":
        cache._flag_host[0] = 1
        with pytest.raises(InputError, match="NaN or Inf"):
            cache.append(k, v)
    elif change == "full":
        while cache.num_tokens < cache.capacity:
            cache.append(*_tokens(cache, 1, gen))
        checks.clear()
        with pytest.raises(InputError, match="capacity"):
            cache.append(k, v)
    elif change == "k subclass":
        cache.append(torch.nn.Parameter(k, requires_grad=False), v)
        assert cache.body_tokens == before + 1
    elif change == "strided v":
        cache.append(k, torch.randn(1, 2, 1, 128, generator=gen).half()[..., ::2])   # every other channel
        assert cache.body_tokens == before + 1
    assert checks, "the whole path was not taken"


@pytest.mark.parametrize("change", ["other scale", "no scale", "lse", "q dtype", "q shape", "q strided", "flagged",
                                    "window"])
def test_an_attention_the_fast_path_cannot_vouch_for_takes_the_whole_path(native, change, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    cache, q = _bound_cache(native, gen, window=4 if change == "window" else 0)
    scales = _counting(monkeypatch, "_raise_if_flagged", cache)
    if change == "other scale":
        cache.attention(q, sm_scale=0.1)
        assert len(cache._prepared) == 2
    elif change == "no scale":
        cache.attention(q)
    elif change == "lse":
        out, lse = cache.attention(q, sm_scale=0.125, return_lse=True)
        assert lse.shape == (1, 8)
    elif change == "q dtype":
        with pytest.raises(InputError, match="dtype"):
            cache.attention(q.float(), sm_scale=0.125)
    elif change == "q shape":
        with pytest.raises(InputError, match="shape"):
            cache.attention(q[:, :4], sm_scale=0.125)
    elif change == "q strided":   # every other head of 16: the output stays contiguous all the same
        out = cache.attention(torch.randn(1, 16, 64, generator=gen).half()[:, ::2], sm_scale=0.125)
        assert out.is_contiguous()
    elif change == "flagged":
        cache._flag_host[0] = 1
        with pytest.raises(InputError, match="NaN or Inf"):
            cache.attention(q, sm_scale=0.125)
    elif change == "window":   # a window's plain part: two parts and their merge, never the body-only path
        assert cache._attend is None
        cache.attention(q, sm_scale=0.125)
    assert scales, "the whole path was not taken"


def test_a_tensor_scale_changed_in_place_is_read_again(native, monkeypatch):
    """A softmax scale given as a tensor may change in place between steps (the same object, a new value): the fast
    path, which compares the scale argument, would take it for the one it was bound with and attend with the old
    value. Such a scale takes the whole path every step, which reads its value."""
    gen = torch.Generator().manual_seed(4)
    cache, _, _ = native()
    cache.append(*_tokens(cache, 10, gen))
    q = torch.randn(1, 8, 64, generator=gen).half()
    scale = torch.tensor(0.125)
    for _ in range(3):
        cache.append(*_tokens(cache, 1, gen))
        cache.attention(q, sm_scale=scale)
    assert cache._attend is None
    scale.fill_(0.5)
    read = []
    real = cache_module.check_sm_scale
    monkeypatch.setattr(cache_module, "check_sm_scale", lambda s, d: read.append(real(s, d)) or read[-1])
    cache.attention(q, sm_scale=scale)
    assert read == [0.5]
