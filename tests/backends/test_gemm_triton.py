"""The generated GEMM/GEMV kernel: under Triton's interpreter (fp16) against the float64 plan
executor for each case (k-group INT4/INT2 fold and dequant, per-output-channel, INT8 x INT8),
decode GEMV (m = 1) and GEMM (many rows, partial tiles); AOT builds for sm_90 and sm_100 in a
fresh subprocess; and the launcher's input checks."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from _kernel_cases import DEQUANT_BUILD
from hypothesis import given, note, settings
from hypothesis import strategies as st
from test_triton_aot import ROOT, _env

import foldc
from foldc.errors import InputError, InputTypeError, SpecError
from foldc.gemm import GemmSpec, parse_gemm_encoding
from foldc.gemm.reference import quantize_2d

# (name, weight, activation, m, n, k)
CASES = [
    ("int4 k-group gemv", "k-group:4:64", None, 1, 48, 256),
    ("int2 k-group gemm", "k-group:2:32", None, 9, 40, 256),   # 2*9 < 32: fold
    ("int4 k-group dequant", "k-group:4:32", None, 70, 24, 128),  # 2*64 >= 32: dequant
    ("per-channel int4", "per-channel:4", None, 17, 40, 128),
    ("per-channel int8 gemv", "per-channel:8", None, 1, 64, 128),
    ("int8 x int8", "per-channel:8", "per-token:8", 21, 40, 128),
    ("int8 x int4 act", "per-channel:8", "per-token:4", 5, 24, 128),
    ("int2 group across fields", "k-group:2:128", None, 4, 24, 256),  # g > k/4: one lane, bytes per field
]
FOLDS = {"int4 k-group dequant": {"w": "dequant"}}


def spec_of(weight, activation, m, n, k, symbolic=False):
    return GemmSpec(n, k, parse_gemm_encoding(weight, "weight"), parse_gemm_encoding(activation, "activation"),
                    m=None if symbolic else m)


def operands(spec, m, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, spec.k, generator=gen) * 2 + torch.rand((), generator=gen)
    w = torch.randn(spec.n, spec.k, generator=gen) * 0.5 + 0.1
    xq = quantize_2d(x, spec.activation) if spec.activation else x.half()
    return xq, quantize_2d(w, spec.weight)


@pytest.mark.parametrize("name, weight, activation, m, n, k", CASES, ids=[c[0] for c in CASES])
def test_interpreter_kernel_matches_the_float64_executor(name, weight, activation, m, n, k):
    spec = spec_of(weight, activation, m, n, k)
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh data each run; the seed is in the message
    xq, wq = operands(spec, m, seed)
    kernel = foldc.compile(spec, target="interpret")
    got = kernel(xq, wq)
    want = foldc.compile(spec, target="reference")(xq, wq)
    assert kernel.plan_for().folds == FOLDS.get(name, {o: "acc-fold" for o in ("w", "x") if o == "w" or activation})
    assert got.shape == (m, n) and got.dtype == torch.float16 and torch.isfinite(got).all()
    err = float((got.double() - want).norm() / want.norm())
    rounding = float((want.half().double() - want).norm() / want.norm())  # fp16 output alone
    assert err < 3 * rounding + 1e-4, f"seed={seed}: rel L2 {err:.2e} vs fp16 rounding {rounding:.2e}"


def test_symbolic_m_spec_runs_any_row_count_and_out():
    spec = spec_of("k-group:4:64", None, None, 32, 128, symbolic=True)
    kernel = foldc.compile(spec, target="interpret")
    for m in (1, 3):
        xq, wq = operands(spec, m, 100 + m)
        out = torch.full((m, 32), float("nan"), dtype=torch.float16)
        assert kernel(xq, wq, out=out) is out and not torch.isnan(out).any()
        want = foldc.compile(spec, target="reference")(xq, wq)
        assert float((out.double() - want).norm() / want.norm()) < 2e-3


def test_an_out_that_shares_memory_with_an_input_is_refused():
    """y = x @ w.T into memory the kernel still reads (out=x when n == k, or a view over the weight's
    scales) was a silently wrong answer (61% error under the interpreter): refused, naming the input.
    Disjoint rows of one buffer are fine."""
    from foldc.encoding import AffineTensor

    spec = spec_of("k-group:4:32", None, None, 64, 64, symbolic=True)
    kernel = foldc.compile(spec, target="interpret")
    xq, wq = operands(spec, 4, int(torch.randint(0, 2**31 - 1, ())))
    want = foldc.compile(spec, target="reference")(xq, wq)
    with pytest.raises(foldc.errors.InputError, match="out shares memory with x"):
        kernel(xq, wq, out=xq)
    buf = torch.empty(8, 64, dtype=torch.float16)
    buf[2:6] = xq
    with pytest.raises(foldc.errors.InputError, match="out shares memory with x"):
        kernel(buf[2:6], wq, out=buf[:4])              # rows 2 and 3 are in both
    assert wq.scale.dtype == torch.float16
    store = torch.empty(4 * 64, dtype=torch.float16)   # the weight's scales inside an out-sized buffer
    store[:wq.scale.numel()] = wq.scale.flatten()
    w_in = AffineTensor(wq.codes, store[:wq.scale.numel()].view(wq.scale.shape), wq.zero, wq.encoding, wq.shape[-1])
    with pytest.raises(foldc.errors.InputError, match="out shares memory with w.scale"):
        kernel(xq, w_in, out=store.view(4, 64))
    got = kernel(buf[2:6], wq, out=buf[6:8].new_empty(4, 64))
    assert float((got.double() - want).norm() / want.norm()) < 2e-3
    got = kernel(buf[:4].copy_(xq), wq, out=buf[4:8])  # disjoint rows of one buffer
    assert got.data_ptr() == buf[4:8].data_ptr() and float((got.double() - want).norm() / want.norm()) < 2e-3


@pytest.mark.parametrize("weight, activation", [("k-group:4:32", None), ("per-channel:4", None),
                                                ("per-channel:8", "per-token:8")])
@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_programs_add_up_to_the_whole_sum(weight, activation, split_k):
    """Split-K: programs take disjoint group steps (or chunks of the single group) and add float32
    partials atomically; 3 does not divide the steps, so some programs get fewer."""
    spec = spec_of(weight, activation, 5, 40, 256)
    xq, wq = operands(spec, 5, int(torch.randint(0, 2**31 - 1, ())))
    want = foldc.compile(spec, target="reference")(xq, wq)
    one = foldc.compile(spec, target="interpret", block_k=32)(xq, wq)
    split = foldc.compile(spec, target="interpret", block_k=32, split_k=split_k)(xq, wq)
    rounding = float((want.half().double() - want).norm() / want.norm())
    assert float((split.double() - want).norm() / want.norm()) < 3 * rounding + 1e-4
    assert float((split.double() - one.double()).abs().max()) <= 2e-3 * float(want.abs().max())


@pytest.mark.parametrize("split_k", [1, 2])
def test_plan_launch_and_run_write_what_a_call_writes(split_k):
    """``run(plan_launch(dtype, m), ...)`` into the caller's output (and, with split-k, its float32
    partials buffer, zeroed by run): the same output as ``__call__``; the launch is memoised."""
    spec = spec_of("k-group:4:32", None, 3, 48, 256)
    gemm = foldc.compile(spec, target="interpret", block_k=32, split_k=split_k)
    xq, wq = operands(spec, 3, int(torch.randint(0, 2**31 - 1, ())))
    launch = gemm.plan_launch(torch.float16, 3)
    assert gemm.plan_launch(torch.float16, 3) is launch and launch.grid[2] == split_k == launch.split_k
    out = torch.full((3, 48), float("nan"), dtype=torch.float16)
    partial = torch.full((3, 48), 7.0) if split_k > 1 else None   # stale values: run zeroes them first
    gemm.run(launch, xq, wq, out, partial)
    assert torch.equal(out, gemm(xq, wq))


def test_launcher_checks_inputs():
    spec = spec_of("k-group:4:64", None, 2, 32, 128)
    kernel = foldc.compile(spec, target="interpret")
    xq, wq = operands(spec, 2, 0)
    with pytest.raises(InputTypeError, match="w must be an AffineTensor of encoding k-group:4:64"):
        kernel(xq, torch.randn(32, 128))
    with pytest.raises(InputError, match=r"x has 3 rows and w 32; the spec says m=2, n=32"):
        kernel(torch.randn(3, 128).half(), wq)
    with pytest.raises(InputError, match="x dtype=torch.float32 must be one of"):
        kernel(xq.float(), wq)
    with pytest.raises(SpecError, match="block_m=24 must be a power of two >= 16"):
        foldc.compile(spec, target="interpret", block_m=24)
    with pytest.raises(SpecError, match="target='sm_90' needs a CUDA GPU"):
        if not torch.cuda.is_available():
            foldc.compile(spec, target="sm_90")
        else:
            raise SpecError("target='sm_90' needs a CUDA GPU (skipped: a GPU is present)")



@pytest.mark.parametrize("weight, activation", [("k-group:4:32", None), ("per-channel:8", "per-token:8")])
def test_a_weight_on_another_device_than_x_is_refused(weight, activation):
    """The launcher checked x's device alone: a weight elsewhere reached the kernel (the interpreter raised
    NotImplementedError copying out of a meta weight; on a GPU, Triton's "cannot be accessed" for a CPU weight, or
    another GPU's addresses). Refused by name before anything runs; the same weight on x's device answers."""
    spec = spec_of(weight, activation, None, 24, 128, symbolic=True)
    kernel = foldc.compile(spec, target="interpret")
    xq, wq = operands(spec, 3, int(torch.randint(0, 2**31 - 1, ())))
    out = torch.full((3, 24), float("nan"), dtype=torch.float16)
    with pytest.raises(InputError, match="w is on meta but x is on cpu; move both to one device"):
        kernel(xq, wq.to("meta"), out=out)
    assert torch.isnan(out).all()
    want = foldc.compile(spec, target="reference")(xq, wq)
    assert float((kernel(xq, wq, out=out).double() - want).norm() / want.norm()) < 2e-3


@pytest.mark.parametrize("part", ["zero", "scale", "codes"])
@pytest.mark.parametrize("m", [4, 40])   # the generated kernel's fold, the large-m template's dequant verdict
def test_operands_in_a_layout_the_kernels_do_not_read_are_refused(part, m):
    from foldc.encoding import AffineTensor

    spec = GemmSpec(48, 256, parse_gemm_encoding("k-group:4:32", "weight"))
    kernel = foldc.compile(spec, target="interpret")
    w = quantize_2d(torch.randn(48, 256) * 0.2, spec.weight)
    tensors = {"codes": w.codes, "scale": w.scale, "zero": w.zero}
    # the same values stored column-major: a kernel reading them row-major would be silently wrong
    tensors[part] = tensors[part][0, 0].t().contiguous().t()[None, None]
    bad = AffineTensor(tensors["codes"], tensors["scale"], tensors["zero"], w.encoding, w.head_dim)
    assert torch.equal(bad.dequantize(torch.float64), w.dequantize(torch.float64))
    with pytest.raises(InputError, match=rf"w\.{part if part != 'zero' else 'scale'} has strides .* "
                                         r"pass contiguous tensors: AffineTensor\(w\.codes\.contiguous\(\)"):
        kernel(torch.randn(m, 256).half(), bad)

# -- values a dequant plan rebuilds past fp16 ----------------------------------------------------------------

def _rebuilt_error(w) -> str:
    """The refusal's text for a weight w: its largest |scale * code + zero| as the message writes it."""
    peak = float(w.dequantize(torch.float64)[0, 0].abs().max())
    return (rf"w holds values scale \* code \+ zero up to \|{peak:.6g}\| .* past torch.float16's largest finite "
            r"value 65504")


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(["k-group:4:32", "k-group:2:64", "k-group:4:32:fp32", "k-group:8:32", "per-channel:4"]),
       st.sampled_from([3, 40]), st.floats(70000, 180000), st.integers(0, 2**31 - 1))
def test_a_plan_rebuilding_the_weight_in_fp16_refuses_values_past_65504(weight, m, top, seed):
    """A dequant plan (the generated kernel's of a spec without m for k groups, the large-m template's) rebuilds
    each weight value scale * code + zero in the activation dtype: a value past 65504 became inf in fp16 and the
    output inf or NaN, silently (the quantizer's fp16 scales and zeros fit: values in [0, top] need a scale of
    top / max code). Refused before anything is written, naming the largest value; a plan folding the weight (the
    generated kernel's for one group per row, and every plan at 4 rows) takes the same weight, matching float64."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 24, 256
    spec = spec_of(weight, None, None, n, k, symbolic=True)
    kernel = foldc.compile(spec, target="interpret")
    w = quantize_2d(torch.rand(n, k, generator=gen) * top, spec.weight)
    assert float(w.dequantize(torch.float64).abs().max()) > 65504   # the quantizer took it (scales fit fp16)
    x = (torch.randn(m, k, generator=gen) * 1e-3).half()
    reference = foldc.compile(spec, target="reference")
    fold = kernel.plan_for(torch.float16, m).operands["w"].fold
    note(f"{weight} m={m} fold={fold} template={kernel.plan_launch(torch.float16, m, 2).template}")
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    if fold == "dequant":
        with pytest.raises(InputError, match=_rebuilt_error(w) + r".*pass bfloat16 activations"):
            kernel(x, w, out=out)
        assert torch.isnan(out).all()
    else:   # a plan folding the weight at any m (its codes enter the product, its scales the float32 sums)
        y, ref = kernel(x, w, out=out), reference(x, w)
        assert torch.isfinite(y).all() and float((y.double() - ref).norm() / ref.norm()) < 2e-3
    folded = foldc.compile(spec_of(weight, None, 4, n, k), target="interpret")
    assert folded.plan_for(torch.float16, 4).operands["w"].fold == "acc-fold"
    x4 = x[:4] if m >= 4 else (torch.randn(4, k, generator=gen) * 1e-3).half()
    y, ref = folded(x4, w), reference(x4, w)
    assert torch.isfinite(y).all() and float((y.double() - ref).norm() / ref.norm()) < 2e-3


@settings(max_examples=4, deadline=None)
@given(st.sampled_from([3, 40]), st.integers(0, 2**31 - 1))
def test_a_weight_whose_codes_stay_below_the_overflow_runs(m, seed):
    """The refusal reads the codes stored where the scales and zeros alone would allow a value past 65504: a
    weight whose groups could reach 15 x 8000 but whose codes stop at 7 holds values below 61000, and runs."""
    from foldc.encoding import AffineTensor, pack_codes

    gen = torch.Generator().manual_seed(seed)
    n, k = 24, 256
    spec = spec_of("k-group:4:32", None, None, n, k, symbolic=True)
    codes = torch.randint(0, 8, (1, 1, n, k), generator=gen)
    scale = (torch.rand(1, 1, n, k // 32, generator=gen) * 3000 + 5000).half()
    zero = (torch.rand(1, 1, n, k // 32, generator=gen) * 5000).half()
    w = AffineTensor(pack_codes(codes, 4), scale, zero, spec.weight.affine(k), k)
    assert float((scale.double() * 15 + zero.double()).max()) > 65504   # the bound alone would refuse it
    x = (torch.randn(m, k, generator=gen) * 1e-3).half()
    y, ref = foldc.compile(spec, target="interpret")(x, w), foldc.compile(spec, target="reference")(x, w)
    assert torch.isfinite(y).all() and float((y.double() - ref).norm() / ref.norm()) < 2e-3


def test_a_weight_is_read_for_the_overflow_once_and_again_after_an_in_place_change(monkeypatch):
    """The weight is a model's constant: its values are read once (a device sync), not at every call; a change in
    place (a load_state_dict copying into the tensors) bumps their version and the next call reads them again."""
    import foldc.backends.triton.gemm_launch as launch_module

    calls = []
    check = launch_module.check_rebuilt
    monkeypatch.setattr(launch_module, "check_rebuilt", lambda *a: (calls.append(a[0]), check(*a)))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    spec = spec_of("k-group:4:32", None, None, 24, 256, symbolic=True)
    kernel = foldc.compile(spec, target="interpret")
    w = quantize_2d(torch.rand(24, 256, generator=gen) * 30000, spec.weight)
    x = (torch.randn(5, 256, generator=gen) * 1e-3).half()
    first = kernel(x, w)
    assert torch.equal(kernel(x, w), first) and calls == ["w"]
    w.scale.mul_(4)   # values up to about 120000 now
    with pytest.raises(InputError, match=_rebuilt_error(w)):
        kernel(x, w)
    assert calls == ["w", "w"]


# -- ahead-of-time builds --------------------------------------------------------------------
AOT_CASES = [("int4 k-group", "k-group:4:128", None, 1), ("int2 k-group", "k-group:2:128", None, 16),
             ("int4 split-k", "k-group:4:128", None, 1),
             ("int4 dequant", "k-group:4:128", None, 256), ("per-channel", "per-channel:8", None, 16),
             ("int8 x int8", "per-channel:8", "per-token:8", 256)]
AOT_SCRIPT = r"""
import json, sys
from foldc.backends.triton.gemm_aot import compile_gemm_aot
from foldc.gemm import GemmSpec, parse_gemm_encoding
jobs, root = json.loads(sys.argv[1]), sys.argv[2]
out = []
for name, w, a, m, arch, folder in jobs:
    spec = GemmSpec(4096, 4096, parse_gemm_encoding(w, "weight"), parse_gemm_encoding(a, "activation"), m=m)
    split = 4 if "split" in name else None
    out.append({"name": name, "folder": folder,
                "report": compile_gemm_aot(spec, arch, f"{root}/{folder}", split_k=split)})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def gemm_builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemm_aot")
    jobs = [(name, w, a, m, arch, f"{name.replace(' ', '_')}_{arch}")
            for name, w, a, m in AOT_CASES for arch in ("sm_90", "sm_100")]
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT, json.dumps(jobs), str(root)], cwd=ROOT,
                          env=_env(str(root / "cache")), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:
        r["dir"] = root / r["folder"]
    return results


def test_gemm_aot_builds_use_tensor_cores(gemm_builds, report_table):
    lines = [f"{'arch':<7} {'case':<14} {'folds':<36} {'inputs':<6} {'wgmma':>5} {'tcgen05':>7} {'mma.sync':>8}"]
    for r in gemm_builds:
        rep, mma = r["report"], r["report"]["mma"]
        lines.append(f"{rep['arch']:<7} {r['name']:<14} {json.dumps(rep['folds']):<36} {rep['mma_inputs']:<6} "
                     f"{mma['wgmma']:>5} {mma['tcgen05']:>7} {mma['mma.sync']:>8}")
        assert sum(mma.values()) >= 1, (r["name"], rep["arch"], mma)
        cubin = (r["dir"] / f"foldc_gemm.{rep['arch']}.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF" and len(cubin) == rep["cubin_bytes"]
        assert f".target {rep['arch']}a" in (r["dir"] / f"foldc_gemm.{rep['arch']}.ptx").read_text()
        assert "def foldc_gemm(" in (r["dir"] / "foldc_gemm.py").read_text()
    report_table("Triton AOT builds of the GEMM kernels (4096 x 4096)", lines)
    by = {(r["name"], r["report"]["arch"]): r["report"] for r in gemm_builds}
    assert by[("int8 x int8", "sm_90")]["mma_inputs"] == "int8"
    assert by[("int4 dequant", "sm_90")]["folds"] == {"w": "dequant"}
    assert by[("int4 k-group", "sm_100")]["folds"] == {"w": "acc-fold"}
    assert by[("int4 split-k", "sm_90")]["split_k"] == 4 and by[("int4 k-group", "sm_90")]["split_k"] == 1


TMEM_SCRIPT = r"""
import json, sys, tempfile
from foldc.backends.triton.gemm_aot import compile_gemm_aot
from foldc.errors import SpecError
from foldc.gemm import GemmSpec, parse_gemm_encoding
spec = GemmSpec(4096, 4096, parse_gemm_encoding("k-group:4:128", "weight"))
out = []
for bm, bn in ((256, 256), (128, 256)):
    try:
        rep = compile_gemm_aot(spec, "sm_100", tempfile.mkdtemp(), dtype="fp16", m=512, block_m=bm, block_n=bn)
        out.append(["built", sum(rep["mma"].values())])
    except SpecError as e:
        out.append(["refused", str(e)])
print(json.dumps(out))
"""


def test_aot_refuses_an_sm100_tile_past_tensor_memory(tmp_path):
    """256 x 256 tiles of a 4-bit weight need 576+ columns of sm_100's 512 (Triton builds a bare trap): refused
    by name; 128 x 256 fits and builds tensor-core MMAs."""
    proc = subprocess.run([sys.executable, "-c", TMEM_SCRIPT], cwd=ROOT, env=_env(str(tmp_path)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (what, why), (what2, mmas) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert what == "refused" and "tensor memory on sm_100" in why and "block_m=256, block_n=256" in why
    assert what2 == "built" and mmas >= 1


def test_runtime_check_refuses_a_kernel_compiled_past_tensor_memory(monkeypatch):
    """On sm_100 the first launch of each planned tile compiles it without launching and refuses a build past
    the 512 columns of tensor memory (the check the AOT test shows Triton needs); once fine, it is not redone."""
    from types import SimpleNamespace

    kern = foldc.compile(GemmSpec(256, 256, parse_gemm_encoding("k-group:4:64", "weight")), target="interpret")
    gemm = kern.triton if hasattr(kern, "triton") else kern
    compiled = []

    class Stub:
        def __init__(self, columns):
            self.columns = columns

        def warmup(self, *args, grid, **kwargs):
            compiled.append((grid, kwargs["BLOCK_M"]))
            return SimpleNamespace(metadata=SimpleNamespace(tmem_size=self.columns))

    from foldc.backends.triton import gemm_launch

    w = quantize_2d(torch.randn(256, 256) * 0.05, parse_gemm_encoding("k-group:4:64", "weight"))
    module, ks, plan = gemm.kernel("fp16")
    for m, template in ((8, "generated"), (40, "dequant")):     # a fold at 8 rows, the template's dequant at 40
        x = torch.randn(m, 256, dtype=torch.float16)
        out = torch.empty(m, 256, dtype=torch.float16)
        launch = gemm.plan_launch(torch.float16, m, 148, "sm_100")
        assert launch.arch == "sm_100" and launch.template == template
        compiled.clear()
        for columns, ok in ((576, False), (512, True)):
            stub = Stub(columns)
            monkeypatch.setattr(gemm, "kernel", lambda dtype, s_=stub: (SimpleNamespace(foldc_gemm=s_), ks, plan))
            monkeypatch.setattr(gemm_launch, "load_module", lambda src, interp, s_=stub: SimpleNamespace(
                foldc_gemm_dequant=s_))
            if ok:
                gemm._check_tensor_memory(launch, x, w, out)
                assert id(launch) in gemm._fits
            else:
                with pytest.raises(SpecError, match="576 columns of tensor memory on sm_100"):
                    gemm._check_tensor_memory(launch, x, w, out)
                assert id(launch) not in gemm._fits
        assert compiled == [(launch.grid, dict(launch.constants)["BLOCK_M"])] * 2
    assert gemm.plan_launch(torch.float16, 40, 148, "sm_90").arch == "sm_90"


@st.composite
def kernel_cases(draw):
    bits = draw(st.sampled_from([2, 4, 8]))
    k = draw(st.sampled_from([128, 256]))
    lane = k // (8 // bits)
    kind = draw(st.sampled_from(["k-group", "per-channel", "int8xint8"]))
    if kind == "k-group":
        weight, act = f"k-group:{bits}:{draw(st.sampled_from([g for g in (32, 64, 128) if lane % g == 0 or g % lane == 0]))}", None
    elif kind == "per-channel":
        weight, act = f"per-channel:{bits}", None
    else:
        weight, act = "per-channel:8", f"per-token:{bits}"
    return weight, act, draw(st.integers(1, 40)), draw(st.integers(1, 40)), k, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=15, deadline=None)
@given(kernel_cases())
def test_interpreter_kernel_property(case):
    """Random encodings, bit widths, groups and shapes (partial row and column tiles)."""
    weight, act, m, n, k, seed = case
    spec = spec_of(weight, act, m, n, k)
    note(spec.describe())
    xq, wq = operands(spec, m, seed)
    got = foldc.compile(spec, target="interpret")(xq, wq)
    want = foldc.compile(spec, target="reference")(xq, wq)
    rounding = float((want.half().double() - want).norm() / want.norm())
    # each output is one fp16 rounding of a float32 sum: within one fp16 unit of the float64 answer (a sum near a
    # rounding boundary may round the other way), which a few outputs' norm can put above 3x the rounding itself
    ulp = float(torch.ldexp(torch.ones_like(want), torch.frexp(want.abs().clamp_min(2.0 ** -14))[1] - 11).norm()
                / want.norm())
    assert float((got.double() - want).norm() / want.norm()) < max(3 * rounding, ulp) + 1e-4


# ---- 64-bit row offsets ------------------------------------------------------------------------------------
# A row's offset (row x stride) passes 2**31 - 1 for an int8 weight over 2 GiB or an output over 2**31 elements,
# and int32 arithmetic (Triton's, for int32 strides) wraps it. Both kernels move each pointer to the tile's first
# row once in int64 and keep the loop's offsets int32.

TTIR_SCRIPT = DEQUANT_BUILD + r"""
import json, tempfile
from foldc.backends.triton.gemm_aot import compile_gemm_aot
from foldc.gemm import GemmSpec, parse_gemm_encoding
out = {}
d = tempfile.mkdtemp()
spec = GemmSpec(4096, 4096, parse_gemm_encoding("per-channel:8", "weight"))
compile_gemm_aot(spec, "sm_90", d, dtype="fp16", m=17)
out["generated"] = open(f"{d}/foldc_gemm.sm_90.ttir").read()
out["dequant"] = dequant_build(1).asm["ttir"]
print(json.dumps(out))
"""


def pointer_bases_and_loop(ttir: str) -> tuple[dict, list]:
    """(pointer argument -> whether it moves by an i64 offset before any loop, the lines of the kernel's loops)
    of a kernel's TTIR."""
    header = re.search(r"tt\.func public @\w+\((.*?)\)\s*attributes", ttir, re.S).group(1)
    pointers = re.findall(r"%(\w+): !tt\.ptr<", header)
    first_loop = ttir.index("scf.for")
    before = ttir[:first_loop]
    moved = {p: bool(re.search(rf"tt\.addptr %{p}, %\w+ : !tt\.ptr<\w+>, i64", before)) for p in pointers}
    loops, depth = [], None
    for line in ttir.splitlines():
        indent = len(line) - len(line.lstrip())
        if depth is None and "scf.for" in line:
            depth = indent
        elif depth is not None:
            if indent <= depth and line.strip().startswith("}"):
                depth = None
            else:
                loops.append(line)
    return moved, loops


def test_both_gemm_kernels_move_every_pointer_in_int64_and_keep_the_loop_32_bit(tmp_path):
    """TTIR of the generated kernel (INT8 weight, m = 17 tiles) and of the dequantize-then-dot template with int32
    strides: every pointer argument (codes, scales, zeros, activation, output) moves to its tile by an i64 offset
    before the k loop, and the loop does no 64-bit arithmetic (its instructions are the 32-bit kernel's)."""
    proc = subprocess.run([sys.executable, "-c", TTIR_SCRIPT], cwd=ROOT, env=_env(str(tmp_path)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, ttir in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        moved, loop = pointer_bases_and_loop(ttir)
        assert len(moved) >= 5 and all(moved.values()), (name, moved)
        assert loop and not [ln for ln in loop if "i64" in ln], (name, [ln for ln in loop if "i64" in ln][:3])


def test_a_tile_spanning_past_32_bit_offsets_is_refused():
    """The loop's offsets count from the tile's first row in int32: a row stride whose tile spans 2**31 elements is
    refused by name (meta tensors: nothing allocated); a stride of 2**31 or more goes in as int64 and is taken."""
    from foldc.backends.triton.gemm_launch import INT32_MAX, TritonGemm, check_tile_span
    from foldc.encoding import AffineTensor
    spec = spec_of("per-channel:8", None, 17, 64, 128)
    gemm = TritonGemm(spec, "interpret")
    launch = gemm.plan_launch(torch.float16, 17)
    block_m = dict(launch.constants)["BLOCK_M"]
    w = operands(spec, 1, 0)[1]
    stride = INT32_MAX // (block_m - 1) + 1
    x = torch.empty(17, stride, device="meta", dtype=torch.float16)[:, :128]
    out = torch.empty(17, 64, device="meta", dtype=torch.float16)
    with pytest.raises(InputError, match=rf"x has row stride {stride}.*limit {INT32_MAX}"):
        check_tile_span(launch, x, w, out)
    check_tile_span(launch, torch.empty(17, 2**31, device="meta", dtype=torch.float16)[:, :128], w, out)
    check_tile_span(launch, torch.empty(17, 128, device="meta", dtype=torch.float16), w, out)
    assert isinstance(w, AffineTensor)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (about 20 GB free)")


def _tail_check(got, x, w, spec, first_row: int, first_col: int) -> None:
    """got's rows from first_row and columns from first_col against float64 x @ w.T over those rows of w."""
    from foldc.encoding import AffineTensor
    tail = AffineTensor(w.codes[:, :, first_col:], w.scale[:, :, first_col:], w.zero[:, :, first_col:], w.encoding,
                        w.head_dim)
    want = (x[first_row:].double() @ tail.dequantize(torch.float64)[0, 0].T)
    err = float((got[first_row:, first_col:].double() - want).norm() / want.norm())
    assert err < 2e-3, f"rel L2 {err:.2e} past the 2**31 element offset"


@gpu
def test_gpu_int8_weight_over_2_gib_matches_float64_past_the_32_bit_offset():
    """An INT8 weight of n x k > 2**31 bytes at m = 17 and 70 (generated kernel and template): the output columns
    whose weight rows lie past byte 2**31 match float64 (they read wrapped, wrong rows in 32-bit)."""
    k = 16384
    n = 2**31 // k + 256
    spec = GemmSpec(n, k, parse_gemm_encoding("per-channel:8", "weight"))
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    w = quantize_2d(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.float16) * 0.1 + 0.01, spec.weight)
    assert w.codes[0, 0].numel() > 2**31
    for m in (17, 70):
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.float16)
        got = foldc.compile(spec)(x, w)
        _tail_check(got, x, w, spec, 0, 2**31 // k - 1)


@gpu
def test_gpu_output_over_2_to_the_31_elements_matches_float64_in_its_last_rows():
    """y = x @ w.T with m x n > 2**31 elements: the last rows (past element 2**31 of y) match float64."""
    n, k = 32768, 256
    m = 2**31 // n + 64
    spec = GemmSpec(n, k, parse_gemm_encoding("k-group:4:64", "weight"))
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    w = quantize_2d(torch.randn(n, k, device="cuda", generator=gen) * 0.1 + 0.01, spec.weight)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.float16)
    got = foldc.compile(spec)(x, w)
    assert got.numel() > 2**31
    _tail_check(got, x, w, spec, 2**31 // n - 1, 0)


@gpu
@pytest.mark.parametrize("weight", ["k-group:4:128", "k-group:2:64"])
def test_gpu_large_m_template_refuses_fp16_values_past_65504_and_runs_bf16(weight):
    """On a GPU the large-m template rebuilds each weight value in x's dtype: with fp16 x a weight holding values past
    65504 is refused (reading the device's codes once), nothing written; the same weight with bf16 x matches float64."""
    gen = torch.Generator().manual_seed(1234)
    n, k, m = 256, 1024, 64
    spec = spec_of(weight, None, None, n, k, symbolic=True)
    kernel = foldc.compile(spec, target="auto")
    w = quantize_2d(torch.rand(n, k, generator=gen) * 150000, spec.weight).to("cuda")
    assert kernel.triton.plan_launch(torch.float16, m, 132).template == "dequant"   # (GemmKernel: m > 16)
    x = (torch.randn(m, k, generator=gen) * 1e-3).cuda()
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    with pytest.raises(InputError, match=_rebuilt_error(w) + r".*pass bfloat16 activations"):
        kernel(x.half(), w, out=out)
    assert torch.isnan(out).all()
    y = kernel(x.bfloat16(), w)
    ref = foldc.compile(spec, target="reference")(x.bfloat16().double().cpu(), w.to("cpu"))
    err = float((y.double().cpu() - ref).norm() / ref.norm())
    assert torch.isfinite(y).all() and err < 1e-2, f"rel L2 {err:.2e}"


def test_int8_code_products_past_the_int32_accumulator_are_refused_not_wrapped():
    """Two 8-bit operands contract their biased codes (c - 128, eq. 7) as int8 x int8 in an int32 accumulator,
    one program's share of k at a time: each product is up to 128 * 128, so past 131071 of them the sum wrapped.
    ReLU-like sparse activation rows against weight rows mostly at their minimum (codes 0, -128 biased) over
    k = 163840 gave -inf for outputs near -30 under the interpreter (about -8e5 in bf16). Refused now, naming the
    split_k that fits; with it (or fold_policy='dequant') the answer is the float64 executor's."""
    k = 163840
    spec = spec_of("per-channel:8", "per-token:8", 2, 3, k)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = torch.relu(torch.randn(2, k, generator=gen)) * (torch.rand(2, k, generator=gen) < 0.01)
    w = torch.relu(torch.randn(3, k, generator=gen)) * (torch.rand(3, k, generator=gen) < 0.01) - 0.05
    xq, wq = quantize_2d(x, spec.activation), quantize_2d(w, spec.weight)
    want = foldc.compile(spec, target="reference")(xq, wq)
    with pytest.raises(SpecError, match=r"k=163840.*int32 accumulator.*split_k=2"):
        foldc.compile(spec, target="interpret", block_k=256)(xq, wq)
    got = foldc.compile(spec, target="interpret", block_k=256, split_k=2)(xq, wq)
    # the biased code products sum to about 2.7e9 per output (near -30) before the zero terms cancel them: one
    # float32 rounding of each program's int32 sum there is about 4e-4 of the output (8 seeds: 3.7e-4 to 8.3e-4)
    # where a wrapped sum is off by orders of magnitude
    assert float((got.double() - want).norm() / want.norm()) < 4e-3
