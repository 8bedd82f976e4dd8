"""The register-operand GEMV (foldc/backends/gluon/gemv.py): its lowering from the GEMM plan, the
chunk and piece algebra it runs (emulated in float64 on fresh random weights), the GEMM callable's
routing and option checks, ahead-of-time builds for sm_90 and sm_100 (a fresh subprocess, no GPU),
and on a GPU the kernel itself against the float64 reference (skipped without one)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _kernel_cases import ROOT, LaunchRecorder, native_env
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

import foldc
from foldc.backends.gluon.gemv_launch import GluonGemv, default_split
from foldc.backends.gluon.gemv_lower import MAX_PIECES, NotLowerable, lower_gemv, weight_code_bias
from foldc.backends.gluon.operands import BF16_CODE_BIAS, biased_field_shift, biased_key_unpack_asm
from foldc.encoding import unpack_codes
from foldc.errors import SpecError
from foldc.gemm import GemmSpec, parse_gemm_encoding
from foldc.gemm.plan import gemm_plan
from foldc.gemm.reference import gemm_reference, quantize_2d

ENCODINGS = ["k-group:4:128", "k-group:4:64", "k-group:4:32", "k-group:2:128", "k-group:2:64", "k-group:2:32",
             "k-group:8:128", "k-group:8:32", "per-channel:8", "per-channel:4", "per-channel:2",
             "k-group:4:128:bf16", "k-group:2:128:fp32", "k-group:2:256", "k-group:4:1024"]


def spec_of(enc: str, n: int, k: int, m: int | None = None) -> GemmSpec:
    return GemmSpec(n, k, parse_gemm_encoding(enc, "weight"), m=m)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_every_piece_lies_in_one_field_and_one_group(enc):
    spec = spec_of(enc, 64, 2048)
    kern = lower_gemv(gemm_plan(spec_of(enc, 64, 2048, m=1)), 1)
    assert kern.pieces <= MAX_PIECES and kern.pieces % kern.fields == 0
    assert kern.row_bytes % kern.chunk_bytes == 0 and kern.chunk_bytes % 32 == 0
    per_field = kern.pieces // kern.fields
    for c in range(kern.chunks):
        for p in range(kern.pieces):
            field, within = divmod(p, per_field)
            bytes_ = range(c * kern.chunk_bytes + within * (kern.chunk_bytes // per_field),
                           c * kern.chunk_bytes + (within + 1) * (kern.chunk_bytes // per_field))
            ks = [field * kern.row_bytes + b for b in bytes_]   # planar packing: field i of byte j is k i*K/F + j
            groups = {k // kern.group for k in ks}
            assert groups == {kern.piece_group(c, p)}, (spec.describe(), c, p, groups)


def _fold_emulated(xv: torch.Tensor, wq, kern) -> torch.Tensor:
    """y the way the kernel sums it, in float64: per chunk and piece, the codes' product with x times
    the group's scale plus the group's zero times the piece's sum of x. With the plan's code bias (bf16
    activations) the codes enter as ``bias + code * 2^shift`` (operands.biased_key_unpack_asm), the scale
    is taken times 2^-shift and the zero less bias times that."""
    codes = unpack_codes(wq.codes[0, 0], kern.bits).to(torch.float64)   # [n, k] in channel order
    s, z = wq.scale[0, 0].double(), wq.zero[0, 0].double()
    per_field = kern.pieces // kern.fields
    span = kern.chunk_bytes // per_field
    y = torch.zeros(xv.shape[0], codes.shape[0], dtype=torch.float64)
    for c in range(kern.chunks):
        for p in range(kern.pieces):
            field, within = divmod(p, per_field)
            k0 = field * kern.row_bytes + c * kern.chunk_bytes + within * span
            g = kern.piece_group(c, p)
            shift = biased_field_shift(kern.bits, field) if kern.code_bias else 0
            part = xv[:, k0:k0 + span] @ (kern.code_bias + codes[:, k0:k0 + span] * 2.0 ** shift).T
            sp = s[:, g] * 2.0 ** -shift
            y += part * sp + xv[:, k0:k0 + span].sum(1, keepdim=True) * (z[:, g] - kern.code_bias * sp)
    return y


@settings(max_examples=40, deadline=None)
@given(enc=st.sampled_from(ENCODINGS), n=st.integers(1, 40), k=st.sampled_from([256, 512, 768, 1024, 2048]),
       m=st.integers(1, 16), dtype=st.sampled_from([torch.float16, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_the_chunk_and_piece_fold_is_the_matmul(enc, n, k, m, dtype, seed):
    """The plan the launcher makes for the call's activation dtype (bf16: with the weight's code bias where
    `weight_code_bias` gives one), lowered and emulated, is the matmul of the dequantized weight."""
    try:
        spec = spec_of(enc, n, k)
        gemv = GluonGemv(spec, "sm_90")
        kern = lower_gemv(gemv.plan_for(dtype, m), m, "bf16" if dtype == torch.bfloat16 else "fp16")
    except (SpecError, NotLowerable) as err:
        note(f"k={k}: {err}")
        assume(False)   # this draw does not lower to the GEMV
    gen = torch.Generator().manual_seed(seed)
    wq = quantize_2d(torch.randn(n, k, generator=gen) * 0.3 + 0.05, spec.weight)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) + 0.2
    want = gemm_reference(x, wq)
    got = _fold_emulated(x, wq, kern)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10 * float(want.abs().max())), (seed, enc, n, k, m)


def test_bf16_activations_plan_the_weight_with_a_code_bias_where_the_budget_allows_it():
    """2- and 4-bit codes under bf16 activations: the plan carries the code bias 128 (eq. 7), is proved, and
    the lowering reads it back; fp16 activations, 8-bit codes and a 2-bit group over a long k keep bias 0.
    A plan whose bias differs from the operand's is refused."""
    assert weight_code_bias(4, 128, "bf16") == weight_code_bias(2, 32, "bf16") == BF16_CODE_BIAS
    assert weight_code_bias(4, 128, "fp16") == weight_code_bias(8, 128, "bf16") == 0
    assert weight_code_bias(2, 14336, "bf16") == 0 and weight_code_bias(4, 14336, "bf16") == BF16_CODE_BIAS
    with pytest.raises(ValueError, match="activation"):
        weight_code_bias(4, 128, "fp32")
    gemv = GluonGemv(spec_of("k-group:4:128", 64, 2048), "sm_90")
    biased = gemv.plan_for(torch.bfloat16, 1)
    assert biased.operands["w"].code_bias == BF16_CODE_BIAS and gemv.plan_for(torch.float16, 1).operands["w"].code_bias == 0
    report = foldc.prove(biased)
    assert any("bias b=128" in lemma for lemma in report.lemmas)   # (prove raises on a plan it cannot prove)
    launch = gemv.plan_launch(torch.bfloat16, 1, 132)
    consts = dict(launch.constants)
    assert launch.kernel.code_bias == consts["BIAS"] == BF16_CODE_BIAS and not consts["XF16"]
    assert (consts["ASM"], consts["CONS"]) == biased_key_unpack_asm(4) and consts["SWAP"]
    assert dict(gemv.plan_launch(torch.float16, 1, 132).constants)["BIAS"] == 0
    with pytest.raises(NotLowerable, match="code bias 128"):
        lower_gemv(biased, 1, "fp16")
    with pytest.raises(NotLowerable, match="code bias 0"):
        lower_gemv(gemv.plan_for(torch.float16, 1), 1, "bf16")
    assert gemv.lowers(torch.float32, 1) == (False, "activation dtype=torch.float32: the GEMV takes torch.float16 "
                                                    "and torch.bfloat16")


def test_dequant_verdicts_encoded_activations_and_tall_calls_are_not_lowered():
    with pytest.raises(NotLowerable, match="dequant"):
        lower_gemv(gemm_plan(spec_of("k-group:4:32", 64, 2048, m=16)), 16)
    with pytest.raises(NotLowerable, match="1 to 16"):
        lower_gemv(gemm_plan(spec_of("k-group:4:128", 64, 2048, m=17)), 17)
    act = GemmSpec(64, 2048, parse_gemm_encoding("per-channel:8", "weight"), parse_gemm_encoding("per-token:8", "activation"))
    with pytest.raises(NotLowerable, match="encoded activations"):
        lower_gemv(gemm_plan(act), 4)
    with pytest.raises(NotLowerable, match="bytes per weight row"):
        lower_gemv(gemm_plan(spec_of("k-group:4:4", 8, 40, m=1)), 1)
    launcher = GluonGemv(spec_of("k-group:4:32", 64, 2048), "sm_90")
    assert launcher.lowers(torch.float16, 1) == (True, "")
    ok, why = launcher.lowers(torch.float16, 16)
    assert not ok and "dequant" in why


def test_options_are_checked_and_the_interpreter_refuses_the_gemv():
    spec = spec_of("k-group:4:128", 64, 2048)
    for bad, match in (({"block_rows": 24}, "block_rows"), ({"split_k": 0}, "split_k"), ({"stages": 9}, "stages"),
                       ({"sub": 3}, "sub"), ({"maxnreg": 16}, "maxnreg"), ({"maxnreg": 96.0}, "maxnreg"),
                       ({"warps": 3}, "warps"), ({"warps": True}, "warps"), ({"chunk_k": 384}, "chunk_k"),
                       ({"chunk_k": True}, "chunk_k")):
        with pytest.raises(SpecError, match=match):
            GluonGemv(spec, "sm_90", **bad)
    with pytest.raises(SpecError, match="sm_90 and sm_100"):
        GluonGemv(spec, "interpret")
    with pytest.raises(SpecError, match="interpret"):
        foldc.compile(spec, target="interpret", kernel="gluon")
    with pytest.raises(SpecError, match="interpret"):
        foldc.compile(spec, target="interpret", block_rows=32)
    capped = GluonGemv(spec, "sm_90", maxnreg=96).plan_launch(torch.float16, 1, 132)
    assert dict(capped.constants)["maxnreg"] == 96 and "maxnreg" not in dict(GluonGemv(spec, "sm_90").plan_launch(torch.float16, 1, 132).constants)


@pytest.mark.parametrize("bits,rows,chunk_bytes", [(2, 1, 128), (2, 4, 64), (2, 16, 64), (4, 1, 128), (4, 8, 128),
                                                     (4, 9, 128), (4, 16, 128), (8, 1, 256), (8, 5, 256), (8, 16, 128)])
def test_default_chunks_by_code_width_and_rows(bits, rows, chunk_bytes):
    """The defaults docs/gemm.md gives: 128 bytes of each weight row for 2- and 4-bit codes at m = 1 (and 4-bit codes
    at every m), 64 for 2-bit codes past one row, 256 channels at m = 2..8 (the activation's chunk in registers) and
    for 8-bit codes up to 8 rows."""
    kern = lower_gemv(gemm_plan(spec_of(f"k-group:{bits}:128", 64, 8192, m=rows)), rows)
    assert kern.chunk_bytes == chunk_bytes and kern.chunk_bytes * kern.fields in (128, 256, 512)


@pytest.mark.parametrize("enc", ["k-group:2:128", "k-group:4:128", "k-group:4:32", "k-group:8:64", "per-channel:4"])
@pytest.mark.parametrize("chunk_k", [128, 256, 512])
def test_chunk_k_sets_the_chunk_and_its_pieces_stay_in_one_group_and_field(enc, chunk_k):
    """``chunk_k`` (the launch option ``gemv_chunk_k``) asks for chunks of that many channels of k: a chunk's bytes
    are chunk_k / fields unless the groups ask for fewer pieces (MAX_PIECES), and every piece of every chunk lies in
    one k group and one bit field (no partial sum crosses a group)."""
    plan = gemm_plan(spec_of(enc, 64, 4096, m=1))
    kern = lower_gemv(plan, 1, "fp16", chunk_k)
    launch = GluonGemv(spec_of(enc, 64, 4096), "sm_90", chunk_k=chunk_k).plan_launch(torch.float16, 1, 132)
    assert launch.kernel == kern and dict(launch.constants)["W"] == kern.chunk_bytes // 4
    assert kern.chunk_bytes * kern.fields <= chunk_k and kern.pieces <= MAX_PIECES
    if kern.pieces // kern.fields == 1:   # one group per field and chunk: the whole chunk asked for
        assert kern.chunk_bytes * kern.fields == chunk_k
    k_of_byte = kern.row_bytes   # planar packing: field f of byte j is k = f * row_bytes + j
    for c in range(kern.chunks):
        for piece in range(kern.pieces):
            field, within = divmod(piece, kern.pieces // kern.fields)
            first = field * k_of_byte + c * kern.chunk_bytes + within * kern.piece_k
            ks = range(first, first + kern.piece_k)
            assert len({k // kern.group for k in ks}) == 1 and len({k // k_of_byte for k in ks}) == 1
            assert kern.piece_group(c, piece) == first // kern.group
    with pytest.raises(ValueError, match="operand_k"):
        lower_gemv(plan, 1, "fp16", 384)


@pytest.mark.parametrize("n,k", [(28672, 8192), (4096, 14336), (14336, 4096), (4096, 4096), (1024, 4096),
                                 (8192, 8192), (256, 2048)])
@pytest.mark.parametrize("m", [1, 8, 9, 16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_default_block_rows_and_split_by_rows(n, k, m, bits):
    """Warps of two row tiles (32 output channels) at 9-16 rows of 4-bit codes, one tile elsewhere; their split
    gives programs of at most WIDE_CHUNKS_PER_PROGRAM chunks (where two stages fit) and at least
    WIDE_PROGRAMS_PER_SM programs an SM (where the chunks allow), the one-tile rule otherwise."""
    from foldc.backends.gluon.gemv_launch import WIDE_CHUNKS_PER_PROGRAM, WIDE_PROGRAMS_PER_SM
    launch = GluonGemv(spec_of(f"k-group:{bits}:128", n, k, m=m), "sm_90").plan_launch(torch.float16, m, 132)
    block, split = dict(launch.constants)["BN"], launch.grid[1]
    assert block == (32 if m > 8 and bits == 4 else 16) and launch.grid[0] == -(-n // block)
    chunks = launch.kernel.chunks
    assert launch.chunks_per_split * split >= chunks and launch.chunks_per_split * (split - 1) < chunks
    if block == 32:
        assert launch.chunks_per_split <= max(WIDE_CHUNKS_PER_PROGRAM, 2) or split == chunks // 2
        assert launch.grid[0] * split >= WIDE_PROGRAMS_PER_SM * 132 or launch.chunks_per_split <= 2
    assert launch == GluonGemv(spec_of(f"k-group:{bits}:128", n, k, m=m), "sm_90", block_rows=block,
                               split_k=split).plan_launch(torch.float16, m, 132)


def test_default_split_keeps_two_chunks_a_program_and_fills_the_gpu():
    kern = lower_gemv(gemm_plan(spec_of("k-group:4:128", 4096, 14336, m=1)), 1)
    split = default_split(kern, 4096, 16, 132, 4)
    assert 1 <= split <= kern.chunks // 8
    assert (4096 // 16) * split >= 8 * 132
    small = lower_gemv(gemm_plan(spec_of("k-group:4:128", 28672, 256, m=1)), 1)
    assert default_split(small, 28672, 16, 132) == 1


@pytest.mark.parametrize("enc,bits", [("k-group:2:128", 2), ("k-group:4:128", 4), ("k-group:8:128", 8)])
def test_the_activation_goes_through_shared_memory_where_it_was_measured_to_pay(enc, bits):
    """X_SHARED: the one row at m = 1 for 2- and 4-bit codes, every row of a chunk at m > 8 for 4-bit codes only (2
    bits were slower, docs/gemm.md), registers otherwise; the launch says which, so that run_rows copies a row whose
    16-byte copies would not be aligned."""
    from foldc.backends.gluon.gemv_launch import activation_copies

    gemv = GluonGemv(spec_of(enc, 4096, 4096), "sm_90")
    for m in range(1, 17):
        want = activation_copies(m, bits)
        assert want == (1 if m == 1 and bits < 8 else 2 if m > 8 and bits == 4 else 0), (m, bits)
        if not gemv.lowers(torch.float16, m)[0]:
            continue
        launch = gemv.plan_launch(torch.float16, m, 132)
        assert dict(launch.constants)["X_SHARED"] == launch.x_shared == want


@settings(max_examples=60, deadline=None)
@given(enc=st.sampled_from(ENCODINGS), n=st.sampled_from([16, 96, 1000, 4096, 28672]),
       k=st.sampled_from([1024, 2048, 4096, 8192, 14336]), m=st.sampled_from([1, 9]),
       block_rows=st.sampled_from([16, 32, 64]), split=st.sampled_from([None, 1, 3, 64]),
       sub=st.sampled_from([None, 1, 2]), warps=st.sampled_from([None, 1, 2, 4]),
       chunk_k=st.sampled_from([None, 128, 512]))
def test_a_launch_covers_every_chunk_once_and_its_parameter_words_fit(enc, n, k, m, block_rows, split, sub, warps,
                                                                      chunk_k):
    """The programs of a block take consecutive runs of whole chunks (the last may be shorter, none
    empty), and each program's parameter words (the kernel's GW per field, row and parameter) hold
    every group its k range meets within PARAM_RUN_BYTES a row."""
    from foldc.backends.gluon.gemv_launch import PARAM_RUN_BYTES, max_chunks, param_words

    try:
        spec = spec_of(enc, n, k)
    except foldc.SpecError:
        assume(False)
    gemv = GluonGemv(spec, "sm_90", block_rows=block_rows, split_k=split, sub=sub, warps=warps, chunk_k=chunk_k)
    assume(gemv.lowers(torch.float16, m)[0])
    launch = gemv.plan_launch(torch.float16, m, 132)
    kern, per, splits = launch.kernel, launch.chunks_per_split, launch.grid[1]
    consts = dict(launch.constants)
    assert consts["num_warps"] == (warps or 1) and consts["BN"] == block_rows * (warps or 1)
    assert launch.grid[0] == -(-n // (block_rows * (warps or 1)))
    assert 1 <= per <= min(kern.chunks, max_chunks(kern)) and (splits - 1) * per < kern.chunks <= splits * per
    gw = dict(launch.constants)["GW"]
    assert gw == param_words(kern, per) and kern.fields * gw * 8 <= PARAM_RUN_BYTES or max_chunks(kern) == 1
    for s in range(splits):   # every group a program's fields meet lies in its GW words
        lo, hi = s * per * kern.chunk_bytes, min((s + 1) * per, kern.chunks) * kern.chunk_bytes
        for f in range(kern.fields):
            first, last = (f * kern.row_bytes + lo) // kern.group, (f * kern.row_bytes + hi - 1) // kern.group
            if kern.group >= kern.k:
                first = last = 0
            count = last - first + 1   # a 16-bit parameter's run may start at a word's upper half
            assert (count if kern.scale_dtype == "fp32" else (count + 2) // 2) <= gw


def test_weight_rows_are_the_checked_weights_rows_and_none_where_a_call_would_be_refused():
    """What `FoldLinear`'s eager calls launch with: the 2-D rows of a weight that passes the call's checks,
    None for one that a call refuses (another encoding, scales that are views of another layout)."""
    from foldc.encoding import AffineTensor
    from foldc.gemm.compile import GemmKernel

    spec = spec_of("k-group:4:128", 96, 1024)
    gemv = GluonGemv(spec, "sm_90")
    w = quantize_2d(torch.randn(96, 1024) * 0.05, spec.weight)
    rows = gemv.weight_rows(w)
    assert rows is not None and rows[0].data_ptr() == w.codes.data_ptr() and tuple(rows[0].shape) == (96, 512)
    assert torch.equal(rows[1], w.scale[0, 0]) and torch.equal(rows[2], w.zero[0, 0])
    other = quantize_2d(torch.randn(96, 1024) * 0.05, parse_gemm_encoding("k-group:4:64", "weight"))
    assert gemv.weight_rows(other) is None
    cols = [t[0, 0].t().contiguous().t()[None, None] for t in (w.scale, w.zero)]   # column-major scales
    assert gemv.weight_rows(AffineTensor(w.codes, cols[0], cols[1], w.encoding, w.head_dim)) is None
    with pytest.raises(foldc.InputError, match="strides"):
        gemv._check_weight(AffineTensor(w.codes, cols[0], cols[1], w.encoding, w.head_dim))
    kernel = GemmKernel(spec, "sm_90")   # a CPU weight never takes the GPU GEMV
    assert kernel.gemv_for(1, torch.float16, torch.device("cpu"), w) is None
    assert gemv.bind(1, torch.float16, torch.device("cpu"), w) is None
    assert gemv.launch_for(torch.float16, 1, torch.device("cpu")).m == 1


AOT = r"""
import json, sys
from foldc.backends.gluon.gemv_aot import compile_gemv_aot
from foldc.gemm import GemmSpec, parse_gemm_encoding
jobs, root = json.loads(sys.argv[1]), sys.argv[2]
out = []
for enc, m, dtype, arch, rows, warps in jobs:
    spec = GemmSpec(4096, 14336, parse_gemm_encoding(enc, "weight"))
    out.append(compile_gemv_aot(spec, arch, f"{root}/{enc}-{m}-{dtype}-{arch}-{rows}-{warps}", m=m, dtype=dtype,
                                block_rows=rows, warps=warps))
print(json.dumps(out))
"""
AOT_JOBS = [("k-group:4:128", 1, "fp16", "sm_90", 16, 1), ("k-group:4:128", 1, "bf16", "sm_90", 16, 1),
            ("k-group:2:128", 1, "fp16", "sm_90", 16, 1), ("k-group:4:32", 1, "fp16", "sm_90", 16, 1),
            ("per-channel:8", 1, "fp16", "sm_90", 16, 1), ("k-group:4:128", 16, "fp16", "sm_90", 16, 1),
            ("k-group:4:128", 1, "fp16", "sm_100", 16, 1), ("k-group:2:128", 1, "bf16", "sm_100", 16, 1),
            ("k-group:4:128", 1, "fp16", "sm_90", 16, 4), ("k-group:4:128", 16, "bf16", "sm_90", 16, 4),
            ("k-group:2:128", 1, "fp16", "sm_90", 32, 2), ("k-group:4:128", 9, "fp16", "sm_100", 16, 4)]


@pytest.fixture(scope="module")
def gemv_builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemv_aot")
    proc = subprocess.run([sys.executable, "-c", AOT, json.dumps(AOT_JOBS), str(root)], cwd=ROOT,
                          env=native_env(root / "cache"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gemv_builds_run_the_unpack_on_tensor_cores_without_spills(gemv_builds, report_table):
    lines = [f"{'arch':<7} {'weight':<14} {'m':>2} {'x':<5} {'warps':>5} {'regs':>4} {'split':>5} {'pieces':>6} "
             f"{'HMMA/stage':>10} {'instr/stage':>11} {'spills':>6}"]
    for job, rep in zip(AOT_JOBS, gemv_builds):
        loop = rep["chunk_loop"]
        lines.append(f"{rep['arch']:<7} {job[0]:<14} {rep['m']:>2} {rep['dtype']:<5} {rep['warps']:>5} {rep['registers']:>4} "
                     f"{rep['split_k']:>5} {rep['pieces']:>6} {loop['mma']:>10} {loop['instructions_per_warp']:>11} "
                     f"{loop['local_memory']:>6}")
        assert rep["mma_in_ptx"] >= 1 and rep["registers"] <= 255
        if rep["arch"] == "sm_90":   # per warp and chunk (sub of them a stage): each of its row tiles' weight MMAs,
            k_steps, n_tiles = rep["operand_k"] // 16, 1 if rep["m"] <= 8 else 2   # and once the ones MMAs (sums of x)
            tiles = rep["block_rows"] // (16 * rep["warps"])
            assert loop["mma"] == rep["sub"] * k_steps * n_tiles * (tiles + 1), rep
        if rep["m"] == 1:
            assert loop["local_memory"] == 0, rep
    report_table("register-operand GEMV builds (4096 x 14336)", lines)


CAPPED = r"""
import json, sys
from foldc.backends.gluon.gemv_aot import compile_gemv_aot
from foldc.gemm import GemmSpec, parse_gemm_encoding
spec = GemmSpec(4096, 14336, parse_gemm_encoding("k-group:4:128", "weight"))
print(json.dumps([compile_gemv_aot(spec, "sm_90", f"{sys.argv[1]}/{cap}", m=1, stages=3, maxnreg=cap) for cap in (96, 72)]))
"""


def test_a_register_cap_reaches_the_build(tmp_path, report_table):
    # more resident one-warp programs per SM is the lever the GEMV's profile points at (docs/gemm.md)
    proc = subprocess.run([sys.executable, "-c", CAPPED, str(tmp_path)], cwd=ROOT, env=native_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reps = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [f"{'maxnreg':>7} {'regs':>4} {'instr/stage':>11} {'spills':>6}"]
    for rep in reps:
        assert rep["registers"] <= rep["maxnreg"] and rep["mma_in_ptx"] >= 1, rep
        loop = rep["chunk_loop"]
        lines.append(f"{rep['maxnreg']:>7} {rep['registers']:>4} {loop['instructions_per_warp']:>11} "
                     f"{loop['local_memory']:>6}")
    report_table("register-operand GEMV with a register cap (INT4 g128, 4096 x 14336, m = 1, 3 stages)", lines)


gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
                         reason="needs an sm_90 or sm_100 GPU")



def test_run_rows_notes_then_binds_then_launches_by_address():
    """`GluonGemv.run_rows` on a stand-in kernel (CPU tensors): the first launch of a launch with one set of
    strides and dtypes goes the ordinary way and is noted, the second binds it, later ones give the bound launch
    the seven tensors' addresses; a bound launch that declines (a misaligned tensor) takes the ordinary way, and
    a launch the kernel cannot bind is not tried again."""
    spec = spec_of("k-group:4:128", 48, 1024)
    gen = torch.Generator().manual_seed(4)
    wq = quantize_2d(torch.randn(48, 1024, generator=gen) * 0.05, spec.weight)
    rows = wq.codes[0, 0], wq.scale[0, 0], wq.zero[0, 0]
    x = torch.randn(1, 1024, generator=gen).half()
    out = torch.empty(1, 48, dtype=torch.float16)
    counters = torch.zeros(8, dtype=torch.int32)
    for bindable in (True, False):
        gemv = GluonGemv(spec, "sm_90")
        gemv._kernel = kernel = LaunchRecorder(bindable)
        launch = gemv.plan_launch(torch.float16, 1, 132)
        for _ in range(5):
            gemv.run_rows(launch, x, *rows, out, counters)
        assert kernel.binds == 1   # bound (or found unbindable) once, at the second launch
        if not bindable:
            assert len(kernel.launches) == 5 and gemv._bindings.bound() == []
            continue
        assert len(kernel.launches) == 2
        ((bound,),) = gemv._bindings.bound()
        assert len(bound.calls) == 3
        assert bound.calls[-1][:5] == (x.data_ptr(), rows[0].data_ptr(), rows[1].data_ptr(), rows[2].data_ptr(),
                                       out.data_ptr()) and bound.calls[-1][6] == counters.data_ptr()
        bound.ok = False
        gemv.run_rows(launch, x, *rows, out, counters)
        assert len(kernel.launches) == 3
        # run_rows says which bound launch ran (FoldLinear's fast path keeps it), None for a keyed launch
        bound.ok = True
        assert gemv.run_rows(launch, x, *rows, out, counters) is bound


def test_the_gemvs_own_workspace_and_counters_are_one_set_per_stream(monkeypatch):
    """Calls without the caller's counters share the GEMV's workspace and counters on one stream (they run in
    order there) and get their own on another (calls on two streams may run at once)."""
    from foldc.backends.gluon import gemv_launch

    gemv = GluonGemv(spec_of("k-group:4:128", 48, 1024), "sm_90")
    launch = gemv.plan_launch(torch.float16, 1, 132)
    stream = [7]
    monkeypatch.setattr(gemv_launch, "stream_handle", lambda device: stream[0])
    first = gemv.buffers(launch, torch.device("cpu"))
    assert gemv.buffers(launch, torch.device("cpu")) is first
    stream[0] = 9
    other = gemv.buffers(launch, torch.device("cpu"))
    assert other[0] is not first[0] and other[1] is not first[1] and not other[1].any()


@gpu
@settings(max_examples=60, deadline=None)
@given(enc=st.sampled_from(ENCODINGS), n=st.integers(1, 300), m=st.integers(1, 16),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]), split=st.sampled_from([None, 1, 3]),
       k=st.sampled_from([2048, 2176]), offset=st.sampled_from([0, 0, 1, 8]), warps=st.sampled_from([None, 2, 4]),
       chunk_k=st.sampled_from([None, None, 128, 512]), seed=st.integers(0, 2**31 - 1))
def test_gpu_gemv_matches_the_float64_reference(enc, n, m, dtype, split, k, offset, warps, chunk_k, seed):
    """k = 2176 gives 17 groups of 128 a row: the 16-bit parameters of odd rows start in a word's upper
    half (the kernel's parameter words are read per row from the word that holds its first group). x is a
    slice ``offset`` elements into wider rows: at an odd offset its rows are only 2-byte aligned (the
    kernel's 16-byte copies of the row at m = 1 take an aligned copy of it). Three calls with fresh x: the
    second binds the launch, the third launches the bound kernel (`FastLaunch.bind`)."""
    try:
        spec = spec_of(enc, n, k)
    except foldc.SpecError:
        assume(False)   # the group does not divide k
    kern = foldc.compile(spec, target="auto", gemv_split=split, gemv_warps=warps, gemv_chunk_k=chunk_k)
    assume(kern.gemv.lowers(torch.float16, m)[0])   # a dequant verdict at m rows: the Triton kernel's, tested there
    gen = torch.Generator().manual_seed(seed)
    wq = quantize_2d((torch.randn(n, k, generator=gen) * 0.05).cuda(), spec.weight)
    for _ in range(3):
        x = ((torch.randn(m, k + offset, generator=gen) + 0.3) * 4).to("cuda", dtype)[:, offset:]
        _check_gemv(kern(x, wq), x, wq, k, dtype, (seed, enc, n, m, dtype, split, offset, warps, chunk_k))


def _check_gemv(y, x, wq, k, dtype, case):
    want = gemm_reference(x, wq)
    err = float((y.double() - want).norm() / want.norm())
    bar = float((x.double().to(dtype).double() @ wq.dequantize(torch.float64)[0, 0].T - want).norm() / want.norm())
    rounding = float((want.to(dtype).double() - want).norm() / want.norm())
    # float32 accumulation: a few units in the last place of the fold's partial sums, whose size is that of
    # sum |x| (|scale x code| + |zero|) <= sum |x| (|w| + 2 |zero|): an output near zero after cancellation
    # (one output, n = 1) is exact only to that, relative to the sums rather than to itself
    zero = wq.zero[0, 0].double()
    zero = zero.repeat_interleave(k // zero.shape[1], dim=1).abs()
    size = x.double().abs() @ (wq.dequantize(torch.float64)[0, 0].abs() + 2 * zero).T
    accumulation = 2.0 ** -22 * float(size.norm() / want.norm())
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert err <= 2 * rounding + 1e-4 + accumulation, (*case, err, rounding, accumulation, bar)


@gpu
@settings(max_examples=10, deadline=None)
@given(n=st.integers(17, 700), m=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_gpu_gemv_with_the_callers_counters_keeps_no_buffer(n, m, seed):
    """Counters from the caller (as FoldLinear passes them): the same answer as the GEMV's own buffers,
    the counters back at zero, nothing kept by the kernel object; a wrong counter tensor is refused."""
    spec = spec_of("k-group:4:128", n, 4096)
    kern = foldc.compile(spec, target="auto", gemv_split=4)
    gen = torch.Generator().manual_seed(seed)
    wq = quantize_2d((torch.randn(n, 4096, generator=gen) * 0.05).cuda(), spec.weight)
    x = (torch.randn(m, 4096, generator=gen) * 3).to("cuda", torch.float16)
    counters = torch.zeros(-(-n // 16), dtype=torch.int32, device="cuda")
    y = kern(x, wq, counters=counters)
    assert kern.gemv._buffers == {}
    assert torch.equal(y, kern(x, wq)) and not counters.any()
    with pytest.raises(foldc.errors.InputError, match="counters"):
        kern(x, wq, counters=counters[:-1] if n > 16 else counters.long())


def test_the_gemm_callable_routes_each_call_by_its_plan():
    from foldc.gemm.compile import GemmKernel

    spec = spec_of("k-group:4:32", 64, 2048)
    kern = GemmKernel(spec, "sm_90")   # built without a GPU: neither kernel compiles before a call
    x = lambda m: torch.zeros(m, 2048, dtype=torch.float16)  # noqa: E731 - routing reads shapes only
    assert kern.uses_gemv(x(1)) and kern.uses_gemv(x(9))
    assert not kern.uses_gemv(x(16))          # groups of 32 at 16 rows: the dequant verdict (eq. 16)
    assert not kern.uses_gemv(x(17))
    assert kern.plan_for(m=1).folds == {"w": "acc-fold"} and kern.plan_for(m=16).folds == {"w": "dequant"}
    wq = quantize_2d(torch.randn(64, 2048), spec.weight)
    assert not kern.uses_gemv(x(1), wq)       # a CPU tensor: the Triton kernel's checks answer
    forced = GemmKernel(spec, "sm_90", kernel="gluon")
    with pytest.raises(foldc.errors.InputError, match="dequant"):
        forced.uses_gemv(x(16))
    assert GemmKernel(spec, "sm_90", kernel="triton").gemv is None
    assert GemmKernel(spec, "sm_90", fold_policy="dequant").gemv is None
    act = GemmSpec(64, 2048, parse_gemm_encoding("per-channel:8", "weight"), parse_gemm_encoding("per-token:8", "activation"))
    assert GemmKernel(act, "sm_90").gemv is None
    with pytest.raises(SpecError, match="GEMV"):
        GemmKernel(act, "sm_90", block_rows=32)
    with pytest.raises(SpecError, match="plain activations"):
        GemmKernel(act, "sm_90", kernel="gluon")
    with pytest.raises(SpecError, match="kernel="):
        GemmKernel(spec, "sm_90", kernel="cuda")


def test_run_rows_refuses_a_weight_past_32_bit_offsets_before_a_launch():
    """The chunk loop keeps 32-bit offsets (64-bit row bases would cost it instructions): a weight whose code
    words pass 2**31 - 1 (an 8-bit n x k of 8 GiB) is refused by name, nothing launched (meta tensors)."""
    from foldc.backends.runtime.offsets import INT32_MAX
    from foldc.errors import InputError
    n, k = 2**20, 2**13 + 2**12
    spec = spec_of("k-group:8:128", n, k)
    gemv = GluonGemv(spec, "sm_90")
    gemv._kernel = kernel = LaunchRecorder(True)
    launch = gemv.plan_launch(torch.float16, 1, 132)
    codes = torch.empty(n, k, device="meta", dtype=torch.uint8)
    scale = torch.empty(n, k // 128, device="meta", dtype=torch.float16)
    x = torch.empty(1, k, device="meta", dtype=torch.float16)
    out = torch.empty(1, n, device="meta", dtype=torch.float16)
    counters = torch.zeros(n // 16, dtype=torch.int32, device="meta")
    words = (n - 1) * k // 4 + k // 4 - 1
    assert words > INT32_MAX
    with pytest.raises(InputError, match=rf"w.codes \(32-bit words\) reaches element offset {words}.*kernel='triton'"):
        gemv.run_rows(launch, x, codes, scale, scale, out, counters, workspace=torch.empty(1, device="meta"))
    assert kernel.launches == []
