"""`EagerCalls` (foldc/backends/gluon/eager.py), the memo of bound eager calls, with stand-in kernels on the CPU
(the device index and stream stand in too): an entry is made only once a call's launches are bound, a call of the
same shapes then hands the bound launches its own addresses, and every call the memo cannot vouch for goes back to
the whole path with nothing launched. The whole path through the real kernels: tests/backends/test_gluon_gpu.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from _kernel_cases import LaunchRecorder

import foldc
import foldc.testing
from foldc.backends.gluon import eager
from foldc.backends.gluon.decode_args import binding_key, decode_addresses
from foldc.backends.gluon.launch import GluonAttention
from foldc.encoding import AffineTensor


class _Resident(GluonAttention):
    def resident(self, launch, q_dtype, has_lens, page, device):
        return 12


@pytest.fixture
def case(monkeypatch):
    """A launcher on stand-in kernels with one bound call: (attn, inputs, decode, merge, launch, ws, lse)."""
    monkeypatch.setattr(eager, "_DEVICE", lambda t: 0)
    monkeypatch.setattr(eager, "_STREAM", lambda device: 7)
    monkeypatch.setattr(eager, "_CAPTURING", lambda: False)
    enc = foldc.Affine(2, "token", 128)
    spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
    attn = _Resident(spec)
    decode, merge = LaunchRecorder(), LaunchRecorder()
    monkeypatch.setattr(attn, "_launchers", lambda: (decode, merge))
    gen = torch.Generator().manual_seed(21)
    q, k, v, _ = foldc.testing.random_inputs(spec, 2, 256, torch.float16, "cpu", gen)
    launch = attn.plan_launch(q.dtype, 2, 256, torch.device("cpu"), k=k, v=v)
    ws, lse = attn._scratch.get(launch, torch.device("cpu"), (2, 32))
    out = torch.empty(2, 32, 128, dtype=q.dtype)

    def whole(q, k, v, out, scale=0.1):   # what __call__'s whole path does after its checks
        attn.run(launch, q, k, v, out, lse, scale, workspace=ws)
        attn._eager.note(attn, launch, q, k, v, scale, out, ws, lse,
                         lambda merging: binding_key(launch.options, q, k, v, None, out, scale, launch.per_split,
                                                     launch.splits, None, merging))

    whole(q, k, v, out)
    assert len(attn._eager) == 0   # launched once: noted by the bindings, not bound, no entry
    whole(q, k, v, out)
    assert len(attn._eager) == 1 and len(decode.bound) == 1
    return attn, (q, k, v, out, gen), decode, merge, ws, lse, whole


def test_a_call_of_the_same_shapes_hands_its_own_addresses_to_the_bound_launches(case):
    attn, (q, k, v, out, gen), decode, merge, ws, lse, whole = case
    q2, k2, v2, _ = foldc.testing.random_inputs(attn.spec, 2, 256, torch.float16, "cpu", gen)   # new tensors
    out2 = torch.empty_like(out)
    assert attn._eager.run(attn, q2, k2, v2, 0.1, out2) is out2
    (bound_decode,), (bound_merge,) = decode.bound, merge.bound
    assert bound_decode.calls[-1] == decode_addresses(q2, k2, v2, None, ws)
    assert bound_decode.values[-1] == (256,)
    assert bound_merge.calls[-1] == (*(t.data_ptr() for t in ws), out2.data_ptr(), lse.data_ptr())
    launches = (len(decode.launches), len(merge.launches))
    bound_merge.ok = False   # the merge's bound launch declines: the ordinary merge launch, the output all the same
    assert attn._eager.run(attn, q2, k2, v2, 0.1, out2) is out2
    assert (len(decode.launches), len(merge.launches)) == (launches[0], launches[1] + 1)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, not contiguous."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.shape[-1] > 1 else \
        t.repeat_interleave(2, dim=-2)[..., ::2, :]


@pytest.mark.parametrize("change", ["batch", "tokens", "scale int", "scale other", "out dtype", "no out",
                                    "equal encoding", "strided scale", "plain v", "captured", "q subclass",
                                    "bound declines"])
def test_a_call_the_memo_cannot_vouch_for_takes_the_whole_path_with_nothing_launched(case, change, monkeypatch):
    attn, (q, k, v, out, gen), decode, merge, ws, lse, whole = case
    scale = 0.1
    if change == "batch":
        q, k, v, _ = foldc.testing.random_inputs(attn.spec, 3, 256, torch.float16, "cpu", gen)
        out = torch.empty(3, 32, 128, dtype=q.dtype)
    elif change == "tokens":
        q, k, v, _ = foldc.testing.random_inputs(attn.spec, 2, 200, torch.float16, "cpu", gen)
    elif change == "scale int":
        scale = 1
    elif change == "scale other":
        scale = 0.125
    elif change == "out dtype":
        out = out.float()
    elif change == "no out":
        out = None
    elif change == "equal encoding":   # equal, not the spec's own object: the whole path compares it
        k = AffineTensor(k.codes, k.scale, k.zero, dataclasses.replace(k.encoding), k.head_dim)
    elif change == "strided scale":
        k = AffineTensor(k.codes, _strided(k.scale), k.zero, k.encoding, k.head_dim)
        assert not k.scale.is_contiguous()
    elif change == "plain v":
        v = v.dequantize().to(q.dtype)
    elif change == "captured":
        monkeypatch.setattr(eager, "_CAPTURING", lambda: True)
    elif change == "q subclass":
        q = torch.nn.Parameter(q, requires_grad=False)
    elif change == "bound declines":   # e.g. a misaligned tensor
        decode.bound[0].ok = False
    calls = (len(decode.bound[0].calls), len(merge.bound[0].calls), len(decode.launches), len(merge.launches))
    assert attn._eager.run(attn, q, k, v, scale, out) is None
    after = (len(decode.bound[0].calls), len(merge.bound[0].calls), len(decode.launches), len(merge.launches))
    declined = change == "bound declines"   # the bound decode was asked and launched nothing
    assert after == (calls[0] + declined, calls[1], calls[2], calls[3])


def test_swapped_kernels_and_a_full_memo_drop_the_entries(case):
    attn, (q, k, v, out, gen), decode, merge, ws, lse, whole = case
    attn._modules = ("another decode", "another merge")
    assert attn._eager.run(attn, q, k, v, 0.1, out) is None
    assert len(decode.bound[0].calls) == 0
    attn._modules = None
    assert attn._eager.run(attn, q, k, v, 0.1, out) is out
    entry = next(iter(attn._eager._held.values()))
    for i in range(eager.MOST - 1):   # the memo full (stand-in keys)
        attn._eager._held[("other shape", i)] = entry
    whole(q, k, v, out, 0.3)
    whole(q, k, v, out, 0.3)   # bound: a new entry, the full memo dropped first
    assert len(attn._eager) == 1 and attn._eager.run(attn, q, k, v, 0.3, out) is out
    assert attn._eager.run(attn, q, k, v, 0.1, out) is None


def test_a_call_without_out_gets_a_new_contiguous_output_each_time(case):
    """An entry made by a call without ``out``: each later call writes a new tensor of q's shape and dtype,
    contiguous (the bound merge gets its address), as the whole path's is."""
    attn, (q, k, v, out, gen), decode, merge, ws, lse, whole = case
    launch = attn.plan_launch(q.dtype, 2, 256, torch.device("cpu"), k=k, v=v)   # the fixture's (memoised)
    attn._eager.note(attn, launch, q, k, v, 0.1, None, ws, lse,
                     lambda merging: binding_key(launch.options, q, k, v, None, out, 0.1, launch.per_split,
                                                 launch.splits, None, merging))
    outs = [attn._eager.run(attn, q, k, v, 0.1, None) for _ in range(3)]
    assert all(o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous() for o in outs)
    assert len({o.data_ptr() for o in outs}) == 3
    assert [c[-2] for c in merge.bound[0].calls[-3:]] == [o.data_ptr() for o in outs]


def test_a_memo_call_with_a_query_that_records_gradients_gets_an_output_whose_backward_raises(case):
    """A call the memo takes runs the kernel, which has no backward: its output had no grad_fn, so a loss through
    it never trained q, silently. Now its backward raises by name; under no_grad the memo's output is ``out``."""
    from foldc.errors import UnsupportedError

    attn, (q, k, v, out, gen), decode, merge, ws, lse, whole = case
    qg = q.clone().requires_grad_()
    launches = len(decode.bound[0].calls)
    got = attn(qg, k, v, sm_scale=0.1, out=out)
    assert len(decode.bound[0].calls) == launches + 1   # the memo's bound launch took it
    assert got.requires_grad and got.data_ptr() == out.data_ptr()
    with pytest.raises(UnsupportedError, match=r"^the attention kernel .* has no backward.*torch\.no_grad\(\)"):
        got.float().sum().backward()
    with torch.no_grad():
        assert attn(qg, k, v, sm_scale=0.1, out=out) is out
    assert attn(q, k, v, sm_scale=0.1, out=out) is out
