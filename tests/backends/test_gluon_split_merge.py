"""The decode kernel that merges its own splits (foldc/backends/gluon/split_merge.py), launched by `GluonAttention`
for eager calls, on stand-in kernels on the CPU: which calls take it (`merges_inside`), that such a call launches
the decode alone, as a cooperative launch whose page-table and counter arguments are its output, log-sum-exp and
barrier, and that its bound launch, the memo of bound calls and a prepared run hand it those addresses. The kernel
itself against float64 on a GPU: tests/backends/test_gluon_gpu.py; ahead of time: tests/backends/test_gluon_aot.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest
import torch
from _kernel_cases import LaunchRecorder, native_env

import foldc
import foldc.testing
from foldc.backends.gluon import eager
from foldc.backends.gluon.decode_args import decode_addresses
from foldc.backends.gluon.launch import GluonAttention
from foldc.backends.gluon.launch_defaults import BARRIER_FIXED, MERGE_MOST_PROGRAMS


def _spec(heads="32/8", bits=2):
    enc = foldc.Affine(bits, "token", 128)
    hq, hkv = map(int, heads.split("/"))
    return foldc.AttentionSpec(hq, hkv, 128, enc, enc)


class _Merging(GluonAttention):
    """A launcher on stand-in kernels whose CPU calls merge inside the decode (`merges_inside` as on a GPU whose
    check passes), with a CPU barrier."""

    def resident(self, launch, q_dtype, has_lens, page, device, merged=False):
        return 12

    def merges_inside(self, launch, q, splits, contiguous_out, paged=None, has_lens=False):
        return self.merge_in_decode and paged is None and contiguous_out

    def barrier(self, q, groups):
        if not hasattr(self, "_cpu_barrier"):
            self._cpu_barrier = torch.zeros(BARRIER_FIXED + groups, dtype=torch.int64)
        return self._cpu_barrier


@pytest.fixture
def merging(monkeypatch):
    attn = _Merging(_spec())
    decode, merge = LaunchRecorder(), LaunchRecorder()
    monkeypatch.setattr(attn, "_launchers", lambda: (decode, merge))
    gen = torch.Generator().manual_seed(31)
    q, k, v, _ = foldc.testing.random_inputs(attn.spec, 2, 256, torch.float16, "cpu", gen)
    return attn, decode, merge, q, k, v, gen


def test_a_merging_call_launches_the_decode_alone_with_its_output_lse_and_barrier(merging):
    attn, decode, merge, q, k, v, gen = merging
    launch = attn.plan_launch(torch.float16, 2, 256, torch.device("cpu"))
    ws, lse = attn._scratch.get(launch, torch.device("cpu"), (2, 32))
    out = torch.empty(2, 32, 128, dtype=q.dtype)

    def call(tokens=256):
        attn.launch(launch.options, q, k, v, None, ws, out, lse, 0.1, launch.per_split, launch.splits, tokens)

    call()
    assert (len(decode.launches), len(merge.launches)) == (1, 0)
    (_, args), kwargs = decode.launches[0], decode.keywords[0]
    assert kwargs["MERGE"] is True and kwargs["launch_cooperative_grid"] is True
    barrier = attn.barrier(q, 0)
    assert args[11] is out and args[12] is lse and args[13] is barrier
    call()   # the second: bound (one launch: no merge to bind)
    assert len(decode.bound) == 1 and merge.binds == 0
    for tokens in (256, 200):
        call(tokens)
    assert (len(decode.launches), len(merge.launches)) == (2, 0)
    (bound,) = decode.bound
    want = decode_addresses(q, k, v, None, ws, None, (out, lse, barrier))
    assert bound.calls == [want] * 2 and bound.values == [(256,), (200,)]
    assert want[11:] == (out.data_ptr(), lse.data_ptr(), barrier.data_ptr())
    bound.ok = False   # a bound launch that declines: the ordinary way, still one launch
    call()
    assert (len(decode.launches), len(merge.launches)) == (3, 0)


def test_a_refused_cooperative_launch_falls_back_to_two_launches(merging, monkeypatch):
    """Where the driver refuses the merging decode's cooperative launch (fewer SMs than the device reports, as under
    MPS), the call launches the decode and the merge kernel instead, warns once, and the launcher stops merging; the
    barrier is left untouched. Other launch errors are raised as they are."""
    attn, _, merge, q, k, v, gen = merging

    class Refusing(LaunchRecorder):
        error = "too many blocks in cooperative launch"

        def __getitem__(self, grid):
            def launch_or_refuse(*args, **kwargs):
                if kwargs.get("launch_cooperative_grid") or "illegal" in self.error:
                    raise RuntimeError(f"foldc launch [CUDA]: {self.error}")
                super(Refusing, self).__getitem__(grid)(*args, **kwargs)
            return launch_or_refuse

    decode = Refusing()
    monkeypatch.setattr(attn, "_launchers", lambda: (decode, merge))
    launch = attn.plan_launch(torch.float16, 2, 256, torch.device("cpu"))
    ws, lse = attn._scratch.get(launch, torch.device("cpu"), (2, 32))
    out = torch.empty(2, 32, 128, dtype=q.dtype)
    with pytest.warns(RuntimeWarning, match="cooperative launch"):
        attn.launch(launch.options, q, k, v, None, ws, out, lse, 0.1, launch.per_split, launch.splits, 256)
    assert not attn.merge_in_decode
    assert (len(decode.launches), len(merge.launches)) == (1, 1)
    assert "MERGE" not in decode.keywords[0] and not attn.barrier(q, 0).any()
    attn.merge_in_decode = True
    decode.error = "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"   # the error code's name, as some launchers word it
    with pytest.warns(RuntimeWarning, match="cooperative launch"):
        attn.launch(launch.options, q, k, v, None, ws, out, lse, 0.1, launch.per_split, launch.splits, 256)
    assert not attn.merge_in_decode and len(merge.launches) == 2
    attn.merge_in_decode = True
    decode.error = "an illegal memory access was encountered"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        attn.launch(launch.options, q, k, v, None, ws, out, lse, 0.1, launch.per_split, launch.splits, 256)
    assert attn.merge_in_decode


def test_calls_that_do_not_merge_inside_launch_the_merge_kernel(merging):
    """A launcher told not to (``merge_in_decode = False``) and a non-contiguous output keep two launches, the
    decode's page-table and counter arguments not the output's."""
    attn, decode, merge, q, k, v, gen = merging
    launch = attn.plan_launch(torch.float16, 2, 256, torch.device("cpu"))
    ws, lse = attn._scratch.get(launch, torch.device("cpu"), (2, 32))
    out = torch.empty(2, 32, 128, dtype=q.dtype)
    strided = torch.empty(2, 128, 32, dtype=q.dtype).transpose(1, 2)
    attn.launch(launch.options, q, k, v, None, ws, strided, lse, 0.1, launch.per_split, launch.splits, 256)
    attn.merge_in_decode = False
    attn.launch(launch.options, q, k, v, None, ws, out, lse, 0.1, launch.per_split, launch.splits, 256)
    assert (len(decode.launches), len(merge.launches)) == (2, 2)
    assert all("MERGE" not in kw and "launch_cooperative_grid" not in kw for kw in decode.keywords)
    assert all(args[11] is q and args[13] is q for _, args in decode.launches)


def test_the_memo_of_bound_calls_hands_a_merging_decode_its_addresses(merging, monkeypatch):
    monkeypatch.setattr(eager, "_DEVICE", lambda t: 0)
    monkeypatch.setattr(eager, "_STREAM", lambda device: 7)
    monkeypatch.setattr(eager, "_CAPTURING", lambda: False)
    attn, decode, merge, q, k, v, gen = merging
    launch = attn.plan_launch(q.dtype, 2, 256, torch.device("cpu"), k=k, v=v)
    ws, lse = attn._scratch.get(launch, torch.device("cpu"), (2, 32))
    from foldc.backends.gluon.decode_args import binding_key

    def whole(q, k, v, out):   # what __call__'s whole path does after its checks
        attn.run(launch, q, k, v, out, lse, 0.1, workspace=ws)
        attn._eager.note(attn, launch, q, k, v, 0.1, out, ws, lse,
                         lambda merging: binding_key(launch.options, q, k, v, None, out, 0.1, launch.per_split,
                                                     launch.splits, None, merging))

    out = torch.empty(2, 32, 128, dtype=q.dtype)
    whole(q, k, v, out)
    whole(q, k, v, out)
    assert len(attn._eager) == 1
    q2, k2, v2, _ = foldc.testing.random_inputs(attn.spec, 2, 256, torch.float16, "cpu", gen)
    out2 = torch.empty_like(out)
    assert attn._eager.run(attn, q2, k2, v2, 0.1, out2) is out2
    (bound,) = decode.bound
    assert bound.calls[-1] == decode_addresses(q2, k2, v2, None, ws, None, (out2, lse, attn.barrier(q, 0)))
    assert (len(decode.launches), len(merge.launches)) == (2, 0)
    bound.ok = False   # declined: nothing launched, the caller takes the whole path
    assert attn._eager.run(attn, q2, k2, v2, 0.1, out2) is None


def test_a_prepared_run_hands_a_merging_decode_its_addresses(merging):
    attn, decode, merge, q, k, v, gen = merging
    launch = attn.plan_launch(q.dtype, 2, 256, torch.device("cpu"), k=k, v=v)
    ws, lse = attn._scratch.get(launch, torch.device("cpu"), (2, 32), fresh=True)
    prepared = attn.prepare(launch, k, v, ws, lse, 0.1)
    out = torch.empty(2, 32, 128, dtype=q.dtype)
    for tokens in (256, 256, 100, 17):
        prepared(q, out, tokens)
    assert (len(decode.launches), len(merge.launches)) == (2, 0)
    (bound,) = decode.bound
    assert bound.calls == [decode_addresses(q, k, v, None, ws, None, (out, lse, attn.barrier(q, 0)))] * 2
    assert bound.values == [(100,), (17,)]


def test_a_prepared_run_hands_each_stream_its_own_barrier(merging, monkeypatch):
    """A prepared run bound on one stream and then called on another hands the merging decode that stream's barrier
    (and the first one's again back there): two grids at once on one set of counters would miscount, a program
    merging rows not yet written or waiting for ever."""
    attn, decode, merge, q, k, v, gen = merging
    current, barriers = [1], {}
    monkeypatch.setattr(attn, "barrier", lambda q, groups: barriers.setdefault(
        current[0], torch.zeros(BARRIER_FIXED + groups, dtype=torch.int64)))
    monkeypatch.setattr("foldc.backends.gluon.prepared.stream_handle", lambda device: current[0], raising=False)
    launch = attn.plan_launch(q.dtype, 2, 256, torch.device("cpu"), k=k, v=v)
    ws, lse = attn._scratch.get(launch, torch.device("cpu"), (2, 32), fresh=True)
    prepared = attn.prepare(launch, k, v, ws, lse, 0.1)
    out = torch.empty(2, 32, 128, dtype=q.dtype)
    for stream in (1, 1, 2, 2, 1):   # bound at the second call, on stream 1
        current[0] = stream
        prepared(q, out)
    (bound,) = decode.bound
    assert len(decode.launches) == 2 and len(barriers) == 2
    assert [call[13] for call in bound.calls] == [barriers[s].data_ptr() for s in (2, 2, 1)]

def test_merge_in_decode_set_false_after_calls_were_bound_applies_to_them(merging, monkeypatch):
    """``merge_in_decode = False`` set once calls merging inside are bound: the memo of bound calls drops them, and a
    prepared run bound to the merging decode launches the decode and the merge kernel from then on."""
    monkeypatch.setattr(eager, "_DEVICE", lambda t: 0)
    monkeypatch.setattr(eager, "_STREAM", lambda device: 7)
    monkeypatch.setattr(eager, "_CAPTURING", lambda: False)
    attn, decode, merge, q, k, v, gen = merging
    launch = attn.plan_launch(q.dtype, 2, 256, torch.device("cpu"), k=k, v=v)
    ws, lse = attn._scratch.get(launch, torch.device("cpu"), (2, 32), fresh=True)
    prepared = attn.prepare(launch, k, v, ws, lse, 0.1)
    out = torch.empty(2, 32, 128, dtype=q.dtype)
    for _ in range(3):   # the third bound, merging inside
        prepared(q, out)
    from foldc.backends.gluon.decode_args import binding_key

    for _ in range(2):   # the memo's entry (as __call__'s whole path makes it)
        attn._eager.note(attn, launch, q, k, v, 0.1, out, ws, lse,
                         lambda merging: binding_key(launch.options, q, k, v, None, out, 0.1, launch.per_split,
                                                     launch.splits, None, merging))
    assert len(attn._eager) == 1 and (len(decode.bound[0].calls), len(merge.launches)) == (1, 0)
    attn.merge_in_decode = False
    assert len(attn._eager) == 0 and attn._eager.run(attn, q, k, v, 0.1, out) is None
    prepared(q, out)
    assert len(decode.bound[0].calls) == 1 and len(merge.launches) == 1
    assert decode.launches[-1][1][11] is q and "MERGE" not in decode.keywords[-1]

def test_merges_inside_takes_eager_contiguous_calls_that_fit_a_wave(monkeypatch):
    """The rule on a launcher whose tensors claim a GPU: contiguous, eager, no page table, dynamic tiles, row blocks
    or ragged rows, and a grid of at most `MERGE_MOST_PROGRAMS` programs that one wave of the merging build's
    resident programs (of the call's query dtype: its build stores the output in it) holds."""
    monkeypatch.setattr("foldc.backends.gluon.launch.num_sms", lambda device: 132)
    monkeypatch.setattr("foldc.backends.gluon.launch.capturing", lambda q: False)

    class OnGpu(GluonAttention):
        def resident(self, launch, q_dtype, has_lens, page, device, merged=False):
            assert merged and q_dtype == torch.float16, "the merging build of the call's own query dtype"
            return 3

    attn = OnGpu(_spec())
    q = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), shape=(2, 32, 128),   # a GPU's query
                              dtype=torch.float16)
    launch = attn.launch_config(torch.float16, 2, 4096)
    heads = attn.head_programs(launch)
    most = min(MERGE_MOST_PROGRAMS, 3 * 132) // (2 * heads)
    assert attn.merges_inside(launch, q, most, True)
    assert not attn.merges_inside(launch, q, most + 1, True)   # past one wave (or the cap)
    assert not attn.merges_inside(launch, q, most, False)      # a strided output
    assert not attn.merges_inside(launch, q, most, True, paged=(q, q, 16))
    attn.merge_in_decode = False
    assert not attn.merges_inside(launch, q, most, True)


def test_a_larger_barrier_leaves_the_smaller_ones_alive(monkeypatch):
    """`GluonAttention.barrier` grows a stream's counters for a larger grid without freeing the smaller buffer, whose
    address a bound call or prepared run may still hold; each is zeroed with room for its groups."""
    monkeypatch.setattr("foldc.backends.gluon.launch.stream_handle", lambda device: 5)
    attn = GluonAttention(_spec())
    q = torch.empty(1, 32, 128)
    small = attn.barrier(q, 10)
    assert attn.barrier(q, 60) is small and small.numel() >= BARRIER_FIXED + 60
    large = attn.barrier(q, 500)
    assert large is not small and large.numel() >= BARRIER_FIXED + 500 and not large.any()
    assert [t is small or t is large for t in attn._barriers[(q.device, 5)]] == [True, True]


# merge_splits alone in a one-warp Gluon kernel, built for sm_90 (no GPU needed): its PTX
BARRIER_PTX = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from foldc.backends.gluon.split_merge import merge_splits

@gluon.jit
def probe(OUT, LSE, COUNTERS, WS_M, WS_L, WS_ACC):
    merge_splits(OUT, LSE, COUNTERS, WS_M, WS_L, WS_ACC, gl.program_id(0), gl.program_id(2), 16, 128, 4)

sig = {"OUT": "*bf16", "LSE": "*fp32", "COUNTERS": "*i64", "WS_M": "*fp32", "WS_L": "*fp32", "WS_ACC": "*fp32"}
built = triton.compile(GluonASTSource(probe, sig, constexprs={}), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 1})
print(json.dumps(built.asm["ptx"]))
"""


def test_the_merge_reads_the_workspace_after_an_acquire_of_the_last_arrival(tmp_path):
    """The grid barrier as built (PTX): after the last group's release of the generation, the wait ends on an
    acquire (a load or atomic with acquire semantics at GPU scope, or a fence) before the merge's first read of the
    other programs' rows: a wait on volatile (relaxed) loads alone orders nothing. (Triton makes an atomic add of 0
    an acquire load and drops one whose value is unused, as it dropped the barrier's first acquire.)"""
    script = tmp_path / "probe.py"   # (a jitted function needs a source file)
    script.write_text(BARRIER_PTX)
    done = subprocess.run([sys.executable, str(script)], env=native_env(tmp_path / "triton"), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = json.loads(done.stdout.strip().splitlines()[-1])
    bump = re.search(r"atom\.global\.gpu\.release\.add\.u64", ptx)
    assert bump is not None, "the last group's release of the generation"
    after = ptx[bump.end():]
    first_read = re.search(r"ld\.global(\.v\d)?\.b32", after)   # the merge's first workspace load
    assert first_read is not None
    acquire = r"(ld|atom)\.global\.gpu\.(acquire|acq_rel)|fence\.(acq_rel|sc)\.gpu"
    assert re.search(acquire, after[:first_read.start()]), after[:first_read.start()]
    # every lane waits for one value: no per-lane volatile loads of the generation
    assert "ld.volatile" not in ptx
