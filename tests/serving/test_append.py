"""The quantize-on-append kernel writes exactly what foldc.quantize computes, where it is told,
and nothing else (storage is poisoned with random bits first and compared bit for bit)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.encoding import AffineTensor, scale_shape
from foldc.errors import InputError, InputTypeError, SpecError
from foldc.serving import append_paged, append_quantized

ROOT = Path(__file__).resolve().parents[2]
A = foldc.Affine
SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BITS_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
             torch.uint8: torch.uint8}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (so -0.0 != 0.0 and a NaN equals itself)."""
    return t.view(BITS_VIEW[t.dtype])


def poisoned(enc: A, batch: int, heads: int, tokens: int, head_dim: int, gen) -> AffineTensor:
    """Storage full of random bytes: any write outside the target region shows up."""
    shape = scale_shape(enc, batch, heads, tokens, head_dim)
    width = torch.finfo(enc.scale_dtype).bits // 8

    def noise(n):
        return torch.randint(0, 256, (n * width,), generator=gen, dtype=torch.uint8).view(enc.scale_dtype)

    numel = int(torch.tensor(shape).prod())
    return AffineTensor(
        torch.randint(0, 256, (batch, heads, tokens, head_dim // enc.codes_per_byte), generator=gen, dtype=torch.uint8),
        noise(numel).reshape(shape), noise(numel).reshape(shape), enc, head_dim)


def values(shape, kind: str, dtype: torch.dtype, gen, bits_: int) -> torch.Tensor:
    """Fresh random values of several shapes of trouble."""
    if kind == "normal":
        mag = float(torch.tensor([1e-3, 1.0, 50.0])[torch.randint(0, 3, (), generator=gen)])
        x = torch.randn(shape, generator=gen) * mag + torch.randn((), generator=gen) * mag
    elif kind == "halves":  # ties at .5 of the code grid when a group spans [0, 2**bits - 1]
        x = torch.randint(0, 2 * (2 ** bits_ - 1) + 1, shape, generator=gen).float() / 2
    elif kind == "offset":  # a large common offset and a tiny spread: scale near the subnormals
        x = 300.0 + torch.randn(shape, generator=gen) * 1e-2
    else:  # "constant": constant groups (scale 0) of values the scale dtype may not hold, some not
        x = (torch.randn(shape[:-1] + (1,), generator=gen) * 3000).expand(shape).clone()
        some = torch.rand(shape[:-1] + (1,), generator=gen) < 0.3
        x[..., :1] += torch.rand(shape[:-1] + (1,), generator=gen) * some
    return x.to(dtype)


def expected(before: AffineTensor, x: torch.Tensor, starts: list[int]) -> AffineTensor:
    """``before`` with foldc.quantize(x) copied in at each batch row's start."""
    enc, n = before.encoding, x.shape[2]
    q = foldc.quantize(x, enc)
    codes, scale, zero = before.codes.clone(), before.scale.clone(), before.zero.clone()
    for b, s in enumerate(starts):
        codes[b, :, s:s + n] = q.codes[b]
        rows = slice(s, s + n) if enc.layout == "token" else slice(s // enc.group_size, (s + n) // enc.group_size)
        scale[b, :, rows] = q.scale[b]
        zero[b, :, rows] = q.zero[b]
    return AffineTensor(codes, scale, zero, enc, before.head_dim)


def assert_same_bits(got: AffineTensor, want: AffineTensor) -> None:
    for part in ("codes", "scale", "zero"):
        g, w = getattr(got, part), getattr(want, part)
        mismatch = (bits(g) != bits(w)).nonzero()
        assert mismatch.numel() == 0, f"{part} differs at {mismatch[:4].tolist()} ({mismatch.shape[0]} entries)"


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(["token", "channel"]))
    # head_dims and groups that are no powers of two too: the kernels pad tl.arange and mask (96: Phi-3)
    head_dim = draw(st.sampled_from([16, 32, 48, 64, 80, 96]))
    bits_ = draw(st.sampled_from([2, 4, 8]))
    if layout == "token":
        group = draw(st.sampled_from([g for g in (4, 8, 12, 16, 24, 32, 48, 64, 80, 96) if head_dim % g == 0]))
        tokens = draw(st.integers(1, 40))
        capacity = tokens + draw(st.integers(0, 20))
        offset = draw(st.integers(0, capacity - tokens))
    else:
        group = draw(st.sampled_from([1, 3, 8, 16, 24]))
        ngroups = draw(st.integers(1, 3))
        tokens = ngroups * group
        capacity_groups = ngroups + draw(st.integers(0, 2))
        capacity = capacity_groups * group + draw(st.integers(0, group - 1))  # a partial last scale row
        offset = draw(st.integers(0, capacity_groups - ngroups)) * group
    enc = A(bits_, layout, group, draw(st.sampled_from(SCALE_DTYPES)))
    return dict(enc=enc, head_dim=head_dim, tokens=tokens, capacity=capacity, offset=offset,
                dtype=draw(st.sampled_from([torch.float16, torch.float32, torch.bfloat16])),
                kind=draw(st.sampled_from(["normal", "halves", "offset", "constant"])),
                batch=draw(st.integers(1, 2)), heads=draw(st.integers(1, 3)),
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=80, deadline=None)
@given(case=cases())
def test_kernel_writes_what_quantize_computes_and_nothing_else(case):
    gen = torch.Generator().manual_seed(case["seed"])
    enc, d, n = case["enc"], case["head_dim"], case["tokens"]
    dst = poisoned(enc, case["batch"], case["heads"], case["capacity"], d, gen)
    x = values((case["batch"], case["heads"], n, d), case["kind"], case["dtype"], gen, enc.bits)
    want = expected(dst, x, [case["offset"]] * case["batch"])
    append_quantized(dst, x, case["offset"], target="interpret")
    assert_same_bits(dst, want)


@pytest.mark.parametrize("layout,group", [("token", 16), ("channel", 8)])
def test_ragged_offsets_write_each_row_at_its_own_position(layout, group):
    gen = torch.Generator().manual_seed(11)
    enc = A(4, layout, group)
    dst = poisoned(enc, 3, 2, 64, 32, gen)
    x = torch.randn(3, 2, 16, 32, generator=gen).half()
    starts = [0, 40, 16]
    want = expected(dst, x, starts)
    append_quantized(dst, x, torch.tensor(starts, dtype=torch.int32), target="interpret")
    assert_same_bits(dst, want)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
@pytest.mark.parametrize("layout, target", [("token", "interpret"), ("channel", "interpret"), ("channel", "reference")])
def test_unsigned_offsets_wider_than_a_byte_are_read_as_their_values(dtype, layout, target):
    """Per-row offsets of uint16, uint32 or uint64 (torch's unsigned tensors) raised NotImplementedError from inside
    torch ("min_all" not implemented) when checked; they are read as the int64 values they hold, as without the
    check, and one past dst is refused by name."""
    gen = torch.Generator().manual_seed(13)
    enc = A(4, layout, 16)
    dst = poisoned(enc, 3, 2, 64, 32, gen)
    x = torch.randn(3, 2, 16, 32, generator=gen).half()
    starts = [32, 0, 48]
    want = expected(dst, x, starts)
    append_quantized(dst, x, torch.tensor(starts, dtype=dtype), target=target)
    assert_same_bits(dst, want)
    with pytest.raises(InputError, match="writing 16 tokens at offset 64 needs 80 token slots but dst holds 64"):
        append_quantized(dst, x, torch.tensor([0, 64, 16], dtype=dtype), target=target)
    assert_same_bits(dst, want)


def test_reference_target_writes_the_same_bits_as_the_kernel():
    gen = torch.Generator().manual_seed(5)
    enc = A(2, "channel", 16, torch.bfloat16)
    x = torch.randn(2, 2, 32, 64, generator=gen).to(torch.bfloat16) * 4
    kernel = poisoned(enc, 2, 2, 80, 64, gen)
    ref = AffineTensor(kernel.codes.clone(), kernel.scale.clone(), kernel.zero.clone(), enc, 64)
    offsets = torch.tensor([16, 48])
    append_quantized(kernel, x, offsets, target="interpret")
    append_quantized(ref, x, offsets, target="reference")
    assert_same_bits(kernel, ref)
    assert_same_bits(kernel, expected(ref, x, [16, 48]))


def test_round_half_to_even_and_constant_groups():
    # one token, groups of 8: [0, 3, 0.5, 1.5, 2.5, 1, 2, 3] -> scale 1, zero 0, codes 0 3 0 2 2 1 2 3
    # (ties go to the even code); a constant group gets scale 0 and codes 0
    row = torch.tensor([0, 3, 0.5, 1.5, 2.5, 1, 2, 3] + [-1.25] * 8)
    x = row.reshape(1, 1, 1, 16).half()
    enc = A(2, "token", 8)
    dst = poisoned(enc, 1, 1, 4, 16, torch.Generator().manual_seed(0))
    append_quantized(dst, x, 2, target="interpret")
    got = AffineTensor(dst.codes[:, :, 2:3], dst.scale[:, :, 2:3], dst.zero[:, :, 2:3], enc, 16)
    assert got.unpack().flatten().tolist() == [0, 3, 0, 2, 2, 1, 2, 3] + [0] * 8
    assert got.scale.flatten().tolist() == [1.0, 0.0] and got.zero.flatten().tolist() == [0.0, -1.25]
    assert_same_bits(got, foldc.quantize(x, enc))


def test_a_constant_group_gets_codes_0_even_when_its_zero_is_rounded_far_away():
    # 20000.7 -> float16 zero 20000 and scale 0: (x - zero) / 1 would round to code 1
    for layout in ("token", "channel"):
        enc = A(2, layout, 16)
        x = torch.full((1, 1, 16, 16), 20000.7)
        dst = poisoned(enc, 1, 1, 16, 16, torch.Generator().manual_seed(1))
        append_quantized(dst, x, 0, target="interpret")
        assert int(dst.unpack().count_nonzero()) == 0
        assert dst.scale.unique().tolist() == [0.0] and dst.zero.unique().tolist() == [20000.0]
        assert_same_bits(dst, foldc.quantize(x, enc))


def test_zero_new_tokens_write_nothing():
    gen = torch.Generator().manual_seed(2)
    enc = A(4, "channel", 16)
    dst = poisoned(enc, 1, 2, 32, 32, gen)
    before = AffineTensor(dst.codes.clone(), dst.scale.clone(), dst.zero.clone(), enc, 32)
    append_quantized(dst, torch.randn(1, 2, 0, 32).half(), 16, target="interpret")
    assert_same_bits(dst, before)


@pytest.mark.parametrize("name", ["token", "channel"])
def test_the_gpu_kernels_keep_their_constexpr_parameters(name):
    """The GPU wrapping (a JITFunction, which reads the constexpr parameters from the annotations) marks exactly the
    parameters the kernel's source annotates as constexpr: the token kernel is a copy of its function with its own
    globals, and a copy made from the code object alone had none, so every GPU build of it failed ("Mismatched type
    for start") while the interpreter, which reads no annotations, passed."""
    import inspect

    from foldc.serving import append_kernels

    source = {"token": append_kernels._append_token_kernel, "channel": append_kernels._append_channel_kernel}[name]
    want = {p.name: "constexpr" in str(p.annotation) for p in inspect.signature(source).parameters.values()}
    got = {p.name: p.is_constexpr for p in append_kernels.kernel(name, False).params}
    assert got == want and sum(want.values()) >= 10


AOT_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from foldc.backends.runtime.modules import interpreter
from foldc.serving.append import _kernel
out = []
for layout, x_bf16, scale_kind, per_row, paged, head_dim, *extra in json.loads(sys.argv[1]):
    fn = _kernel(layout, False)
    extra = dict(extra[0]) if extra else {}
    second = extra.pop("SECOND", [2, 32, scale_kind])   # the pair's values: bits, group, scale kind
    ptrs = {"X": "*i16" if x_bf16 else "*fp16", "CODES": "*u8", "SCALE": ["*fp16", "*i16", "*fp32"][scale_kind],
            "OFFSETS": "*i32" if extra.get("ADVANCE") else "*i64", "KV_INDPTR": "*i32", "KV_INDICES": "*i32",
            "COUNTS": "*i32", "FLAG": "*i32", "X2": "*i16" if x_bf16 else "*fp16", "CODES2": "*u8",
            "ARRIVALS": "*i32"}
    # constexpr where the JIT takes one (its parameters' flags, read from the annotations), as a launch builds
    sig = {p.name: ptrs.get(p.name, "constexpr" if p.is_constexpr else "i32") for p in fn.params}
    for a in fn.arg_names:
        if a.startswith("stride"):
            sig[a] = "i64"
    sig["ZERO"] = sig["SCALE"]
    sig["SCALE2"] = sig["ZERO2"] = ["*fp16", "*i16", "*fp32"][second[2]]
    group = 32 if layout == "token" else 128
    width = 1 << (head_dim // 4 - 1).bit_length()    # the padded bytes per token (96 at INT2: 24 -> 32)
    const = dict(HEAD_DIM=head_dim, GROUP=group, BITS=2, CPB=4, MAX_CODE=3,
                 BLOCK_T=16 if layout == "token" else 32, X_BF16=x_bf16, SCALE_KIND=scale_kind, PER_ROW=per_row,
                 PAGED=paged, PAGE_SIZE=128 if paged else 1, HAS_COUNT=paged and not extra.get("ADVANCE"),
                 WIDTH_P=width, **extra)
    if layout == "token":
        groups = head_dim // group
        const.update(NUM_GROUPS=groups, GROUP_P=group, NUM_GROUPS_P=1 << (groups - 1).bit_length())
    if extra.get("PAIR"):
        bits2, group2, kind2 = second
        cpb2, groups2 = 8 // bits2, head_dim // group2
        const.update(BITS2=bits2, GROUP2=group2, NUM_GROUPS2=groups2, CPB2=cpb2, MAX_CODE2=(1 << bits2) - 1,
                     SCALE_KIND2=kind2, GROUP_P2=1 << (group2 - 1).bit_length(),
                     NUM_GROUPS_P2=1 << (groups2 - 1).bit_length(), WIDTH_P2=1 << (head_dim // cpb2 - 1).bit_length())
    with interpreter(False):
        c = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4})
    ptx = c.asm["ptx"]
    out.append({"case": [layout, x_bf16, scale_kind, per_row, paged, head_dim, extra],
                "div_rn": len(re.findall(r"div\.rn\.f32", ptx)),
                "div_approx": len(re.findall(r"div\.(approx|full)\.f32", ptx)), "cubin": len(c.asm["cubin"]),
                "acq_rel_atomics": len(re.findall(r"atom\.[a-z_.]*acq_rel[a-z_.]*add", ptx)),
                "barriers": len(re.findall(r"bar\.sync|barrier\.sync", ptx))})
print(json.dumps(out))
"""


def test_kernels_build_for_sm90_with_correctly_rounded_division(tmp_path):
    """The GPU build (no GPU needed): both kernels compile for sm_90, contiguous and paged (page
    table, per-row counts), at head_dim 128 and 96 (padded), and every float32 division is div.rn (an approximate division would
    break bit-exactness with foldc.quantize). The advancing launches (the paged cache's decode-step pair, of one
    encoding or two, and one operand alone) count their programs with one acquire-release atomic add after a
    barrier."""
    advancing = [["token", True, 1, True, True, 128, {"PAIR": True, "ADVANCE": True}],
                 ["token", False, 0, True, True, 128, {"PAIR": True, "ADVANCE": True, "SECOND": [4, 64, 2]}],
                 ["token", False, 0, True, True, 128, {"ADVANCE": True}]]
    jobs = advancing + [["token", False, 0, False, False, 128], ["token", True, 1, True, False, 128],
            ["channel", False, 2, True, False, 128], ["channel", True, 0, False, False, 128],
            ["token", True, 1, True, True, 128], ["channel", True, 1, True, True, 128],
            ["token", True, 0, False, False, 96], ["channel", False, 0, False, False, 96],   # padded: head_dim 96
            ["token", False, 1, True, False, 96, {"PAIR": True, "SECOND": [8, 48, 2]}]]   # two encodings, padded
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT, json.dumps(jobs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert r["div_rn"] > 0 and r["div_approx"] == 0 and r["cubin"] > 0, r
        advance = bool(r["case"][6].get("ADVANCE"))
        assert (r["acq_rel_atomics"] == 1) == advance and (not advance or r["barriers"] >= 1), r


# ---- errors: one per message ------------------------------------------------------------------

def _dst(layout="token", group=16, tokens=32, device="cpu", head_dim=32):
    enc = A(4, layout, group)
    shape = scale_shape(enc, 1, 2, tokens, head_dim)
    return AffineTensor(torch.zeros(1, 2, tokens, head_dim // 2, dtype=torch.uint8, device=device),
                        torch.zeros(shape, dtype=torch.float16, device=device),
                        torch.zeros(shape, dtype=torch.float16, device=device), enc, head_dim)


def _x(tokens=16, dtype=torch.float16, head_dim=32):
    return torch.randn(1, 2, tokens, head_dim).to(dtype)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: append_quantized(torch.zeros(1, 2, 8, 16), _x(), 0), InputTypeError, "dst must be a foldc.AffineTensor"),
    (lambda: append_quantized(_dst(), _x().numpy(), 0), InputTypeError, "x must be a torch.Tensor"),
    (lambda: append_quantized(_dst(), torch.randn(1, 3, 4, 32).half(), 0), InputError,
     r"x shape=\(1, 3, 4, 32\) but dst needs \[1, 2, tokens, 32\]"),
    (lambda: append_quantized(_dst(), _x(dtype=torch.float64), 0), InputError,
     "x dtype=torch.float64 is not supported"),
    (lambda: append_quantized(_dst(), _x().to("meta"), 0), InputError, "x is on meta but dst is on cpu"),
    (lambda: append_quantized(_dst("channel", 8), _x(12), 0), InputError,
     "x holds 12 tokens, not a multiple of group_size=8"),
    (lambda: append_quantized(_dst(), _x(), torch.tensor([1.0])), InputError,
     "offset dtype=torch.float32 must be an integer"),
    (lambda: append_quantized(_dst(), _x(), torch.tensor([1, 2])), InputError,
     r"offset shape=\(2,\) but dst has batch=1"),
    (lambda: append_quantized(_dst("channel", 8), _x(8), torch.tensor([4])), InputError,
     "offset=4 is not a multiple of group_size=8; .* every offset must start a group"),
    (lambda: append_quantized(_dst(), _x(), 1.5), InputTypeError, "offset=1.5 must be an int"),
    (lambda: append_quantized(_dst("channel", 8), _x(8), 12), InputError,
     "offset=12 is not a multiple of group_size=8; .* the offset must start a group"),
    (lambda: append_quantized(_dst(), _x(), -1), InputError, "offset=-1 is negative"),
    (lambda: append_quantized(_dst(tokens=32), _x(16), 17), InputError,
     "writing 16 tokens at offset 17 needs 33 token slots but dst holds 32; allocate a larger cache"),
    (lambda: append_quantized(_dst(), _x(), 0, target="cuda"), SpecError, "target='cuda' is not available"),
    (lambda: append_quantized(_dst(device="meta"), _x().to("meta"), 0, target="interpret"), InputError,
     "target='interpret' runs on the CPU but the storage is on meta"),
    (lambda: append_quantized(_dst(), _x(), 0, target="sm_90"), InputError,
     "target='sm_90' runs on a CUDA GPU but the storage is on cpu"),
])
def test_bad_calls_name_the_value_and_the_fix(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _empty_rows_call(append: str, rows: tuple[int, int], target: str, offset: str):
    """An append of x with no rows (batch or kv_heads 0) into storage of those rows, by ``append``."""
    batch, heads = rows
    enc = A(4, "token", 16)
    shape = scale_shape(enc, batch, heads, 32, 32)
    dst = AffineTensor(torch.zeros(batch, heads, 32, 16, dtype=torch.uint8), torch.zeros(shape, dtype=torch.float16),
                       torch.zeros(shape, dtype=torch.float16), enc, 32)
    x = torch.randn(batch, heads, 16, 32).half()
    if append == "append_quantized":
        start = torch.zeros(batch, dtype=torch.int32) if offset == "tensor" else 0
        return lambda: append_quantized(dst, x, start, target=target)
    table = torch.arange(batch + 1, dtype=torch.int32), torch.arange(batch, dtype=torch.int32)
    return lambda: append_paged(dst, x, *table, torch.zeros(batch, dtype=torch.int32), page_size=32, target=target)


@pytest.mark.parametrize("append,offset", [("append_quantized", "int"), ("append_quantized", "tensor"),
                                           ("append_paged", "tensor")])
@pytest.mark.parametrize("rows", [(0, 2), (1, 0)])
@pytest.mark.parametrize("target", ["interpret", "reference"])
def test_an_append_of_no_rows_is_refused_by_name(append, offset, rows, target):
    """An empty batch (or no heads): before, a RuntimeError from inside torch (an offset tensor's min), a
    refusal under target="reference" and nothing under the interpreter, depending on the call."""
    with pytest.raises(InputError, match=rf"x shape=\({rows[0]}, {rows[1]}, 16, 32\) holds no rows .* skip the "
                                         "call for an empty batch"):
        _empty_rows_call(append, rows, target, offset)()


def test_nan_and_inf_are_rejected_before_anything_is_written():
    for bad in (float("nan"), float("inf")):
        dst = _dst()
        x = _x()
        x[0, 1, 3, 5] = bad
        with pytest.raises(InputError, match=r"x holds NaN or Inf \(first at index \[0, 1, 3, 5\]\)"):
            append_quantized(dst, x, 0, target="interpret")
        assert int(dst.codes.count_nonzero()) == 0 and int(dst.scale.count_nonzero()) == 0


def test_scale_overflow_is_rejected_as_quantize_rejects_it():
    x = _x(dtype=torch.float32)
    x[0, 0, 0, 0] = -1e6  # zero = min does not fit float16 scales
    with pytest.raises(InputError, match="scale or zero overflow scale_dtype=torch.float16; use float32 scales: 'token:4:16:fp32'"):
        append_quantized(_dst(), x, 0, target="interpret")
    ok = _x(dtype=torch.float32)
    ok[0, 0, 0, 0] = 1e5  # above the float16 range but (max - min) / 15 and min still fit: quantize accepts
    dst = _dst()
    append_quantized(dst, ok, 0, target="interpret")
    assert_same_bits(AffineTensor(dst.codes[:, :, :16], dst.scale[:, :, :16], dst.zero[:, :, :16], dst.encoding, 32),
                     foldc.quantize(ok, dst.encoding))


def test_non_unit_stride_storage_is_rejected():
    enc = A(4, "token", 16)
    codes = torch.zeros(1, 2, 16, 32, dtype=torch.uint8).transpose(2, 3)  # [1, 2, 32 tokens, 16 bytes]
    scale = torch.zeros(1, 2, 32, 2, dtype=torch.float16)
    dst = AffineTensor(codes, scale, scale.clone(), enc, 32)
    with pytest.raises(InputError, match=r"dst.codes must have unit stride along its last dim; got strides"):
        append_quantized(dst, _x(), 0, target="interpret")


def test_reference_target_and_the_kernel_write_the_same_bits_at_head_dim_48():
    for target in ("reference", "interpret"):
        dst = _dst(head_dim=48)
        x = _x(head_dim=48)
        append_quantized(dst, x, 8, target=target)
        assert_same_bits(AffineTensor(dst.codes[:, :, 8:24], dst.scale[:, :, 8:24], dst.zero[:, :, 8:24],
                                      dst.encoding, 48), foldc.quantize(x, dst.encoding))


@pytest.mark.parametrize("layout", ["token", "channel"])
def test_unchecked_tensor_offsets_read_nothing_and_skip_rows_that_do_not_fit(layout, monkeypatch):
    """check=False: the offsets are not read on the host (capturable); a row whose offset would
    write outside dst (or off a group boundary) is skipped, the others are written exactly."""
    gen = torch.Generator().manual_seed(21)
    enc = A(4, layout, 8)
    dst = poisoned(enc, 4, 2, 32, 32, gen)
    before = AffineTensor(dst.codes.clone(), dst.scale.clone(), dst.zero.clone(), enc, 32)
    x = values((4, 2, 16, 32), "normal", torch.float16, gen, 4)
    offsets = torch.tensor([8, 32, -16, 4 if layout == "channel" else 3])
    monkeypatch.setattr(torch.Tensor, "__int__", lambda self: pytest.fail("the offsets were read on the host"))
    append_quantized(dst, x, offsets, target="interpret", check=False)
    monkeypatch.undo()
    # row 1 would start at the end, row 2 end before 0; row 3 is off a group boundary when channel-wise
    starts = {0: 8, 3: 3} if layout == "token" else {0: 8}
    for b in range(4):
        ref = expected(before, x, [starts[b]] * 4) if b in starts else before
        for part in ("codes", "scale", "zero"):
            assert torch.equal(bits(getattr(dst, part)[b]), bits(getattr(ref, part)[b])), (b, part)


@pytest.mark.parametrize("layout", ["token", "channel"])
def test_the_reference_target_skips_unchecked_offsets_as_the_kernel_does(layout):
    """check=False with target="reference": offsets outside dst were Python slice bounds there (-24 wrote the
    row at tokens 8..23, 24 with 16 tokens a bare RuntimeError) and a channel-wise offset off a group boundary
    was written; the reference now writes what the kernel writes, token for token."""
    gen = torch.Generator().manual_seed(23)
    enc = A(4, layout, 8)
    dsts = [poisoned(enc, 6, 2, 32, 32, torch.Generator().manual_seed(24)) for _ in range(2)]
    x = values((6, 2, 16, 32), "normal", torch.float16, gen, 4)
    offsets = torch.tensor([8, 32, -16, 3 if layout == "token" else 4, 24, -24])
    for dst, target in zip(dsts, ("interpret", "reference")):
        append_quantized(dst, x, offsets, target=target, check=False)
    for part in ("codes", "scale", "zero"):
        assert torch.equal(bits(getattr(dsts[1], part)), bits(getattr(dsts[0], part))), part


@pytest.mark.parametrize("enc", [A(2, "token", 32), A(4, "token", 64, torch.bfloat16), A(2, "channel", 16),
                                 A(8, "channel", 32, torch.float32)], ids=lambda e: e.short())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_group_holding_nan_or_inf_gets_nan_scale_and_zero(enc, bad):
    """Without the host check, a non-finite value is not dropped by the group's min/max: its group's
    scale and zero are NaN (so attention over it is NaN), every other group is as foldc.quantize makes it."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, 2, 32, 64, generator=gen).half()
    dst = poisoned(enc, 1, 2, 32, 64, gen)
    x[0, 1, 5, 40] = bad
    append_quantized(dst, x, 0, target="interpret", check=False)
    g = (0, 1, 5, 40 // enc.group_size) if enc.layout == "token" else (0, 1, 5 // enc.group_size, 40)
    assert torch.isnan(dst.scale[g]) and torch.isnan(dst.zero[g])
    clean = x.clone()
    clean[0, 1, 5, 40] = 0.0
    want = foldc.quantize(clean, enc)
    finite = ~torch.isnan(dst.scale)
    assert int((~finite).sum()) == 1
    assert torch.equal(dst.scale[finite], want.scale[finite]) and torch.equal(dst.zero[finite], want.zero[finite])


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(["token", "channel"]), bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([16, 32, 64]),
       batch=st.integers(1, 8), heads=st.integers(1, 8), units=st.integers(1, 40), paged=st.booleans())
def test_an_append_plan_is_memoised_and_sized_from_the_shapes(layout, bits, group, batch, heads, units, paged):
    """`plan_append`: the same frozen launch for the same shapes (no work per decode step), a program per
    (row, head) and per token block (token-wise) or whole group (channel-wise)."""
    import dataclasses
    import math

    from foldc.serving.append import BLOCK_T_CHANNEL, BLOCK_T_TOKEN, plan_append

    enc = foldc.Affine(bits, layout, group)
    tokens = units * (group if layout == "channel" else 1)
    args = (enc, heads, 64, batch, tokens, False, False, 64 if paged else 0, False, True)
    launch = plan_append(*args)
    assert plan_append(*args) is launch
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.grid = (1, 1)
    consts = dict(launch.constants)
    assert consts["PAGED"] == paged and consts["PAGE_SIZE"] == (64 if paged else 1) and consts["BITS"] == bits
    if layout == "token":
        block = min(BLOCK_T_TOKEN, 1 << (tokens - 1).bit_length())
        assert launch.kernel == "token" and launch.grid == (batch * heads, math.ceil(tokens / block))
        assert consts["NUM_GROUPS"] == 64 // group
    else:
        assert launch.kernel == "channel" and launch.grid == (batch * heads, units)
        assert consts["BLOCK_T"] == min(BLOCK_T_CHANNEL, group)


def _pair_write(enc, head_dim, batch, heads, tokens, capacity, offset, dtype, gen, device="cpu", enc2=None):
    """Keys and values written by one pair launch (`plan_append(..., pair=True)`, or ``pair=enc2``: the values in
    an encoding of their own) into poisoned storage: (before k, before v, after k, after v, k, v)."""
    from foldc.serving.append import plan_append, run_append

    encs = (enc, enc2 or enc)
    before = [poisoned(e, batch, heads, capacity, head_dim, gen) for e in encs]
    dsts = [AffineTensor(d.codes.clone().to(device), d.scale.clone().to(device), d.zero.clone().to(device), e,
                         head_dim) for d, e in zip(before, encs)]
    # keys and values as a model makes them: views of one transposed projection each
    k, v = (values((batch, tokens, heads, head_dim), "normal", dtype, gen, e.bits).to(device).transpose(1, 2)
            for e in encs)
    launch = plan_append(enc, heads, head_dim, batch, tokens, dtype == torch.bfloat16, False, 0, False,
                         device == "cpu", False, enc2 or True)
    run_append(launch, dsts[0], k, offset, None, second=(dsts[1], v))
    return before, dsts, k.cpu(), v.cpu()


@settings(max_examples=25, deadline=None)
@given(bits_=st.sampled_from([2, 4, 8]), group=st.sampled_from([16, 32, 64]), scale_dtype=st.sampled_from(SCALE_DTYPES),
       batch=st.integers(1, 2), heads=st.integers(1, 3), tokens=st.integers(1, 20), spare=st.integers(0, 6),
       seed=st.integers(0, 2**31 - 1))
def test_one_pair_launch_writes_keys_and_values_as_quantize_does(bits_, group, scale_dtype, batch, heads, tokens, spare,
                                                                 seed):
    """The pair launch (the serving cache's one-token steps, K and V of one token-wise encoding): the second half
    of the grid writes the values into their own storage, each operand foldc.quantize's bits at the offset and
    nothing else touched (interpreter, fp16)."""
    gen = torch.Generator().manual_seed(seed)
    enc = A(bits_, "token", group, scale_dtype)
    offset = int(torch.randint(0, spare + 1, (), generator=gen))
    before, dsts, k, v = _pair_write(enc, 64, batch, heads, tokens, tokens + spare, offset, torch.float16, gen)
    for b, d, x in zip(before, dsts, (k, v)):
        assert_same_bits(d, expected(b, x, [offset] * batch))


def test_a_pair_launch_takes_token_wise_encodings_only():
    from foldc.serving.append import plan_append

    with pytest.raises(SpecError, match="token-wise"):
        plan_append(A(4, "channel", 16), 2, 64, 1, 16, False, False, 0, False, True, False, True)
    with pytest.raises(SpecError, match="token-wise"):
        plan_append(A(4, "channel", 16), 2, 64, 1, 16, False, False, 0, False, True, False, A(2, "token", 32))
    with pytest.raises(SpecError, match=r"pair=channel:2:16:bf16 is channel-wise: the pair launch writes two "
                                        r"token-wise encodings only"):
        plan_append(A(4, "token", 32), 2, 64, 1, 1, False, True, 0, False, True, pair=A(2, "channel", 16,
                                                                                          torch.bfloat16))
    with pytest.raises(SpecError, match=r"pair='token:2:32' must be True .* or the values' foldc.Affine"):
        plan_append(A(4, "token", 32), 2, 64, 1, 1, False, True, 0, False, True, pair="token:2:32")


def _source(shape: tuple, layout: str, dtype: torch.dtype, gen, bits_: int) -> torch.Tensor:
    """Fresh values [batch, heads, tokens, head_dim] laid out as ``layout``: "contiguous"; "transposed" (a view of
    a [batch, tokens, heads, head_dim] projection, as models make keys and values); "every other token" (a view of
    twice as many tokens)."""
    b, h, n, d = shape
    kind = ["normal", "halves", "offset", "constant"][int(torch.randint(0, 4, (), generator=gen))]
    if layout == "transposed":
        return values((b, n, h, d), kind, dtype, gen, bits_).transpose(1, 2)
    if layout == "every other token":
        return values((b, h, 2 * n, d), kind, dtype, gen, bits_)[:, :, ::2]
    return values(shape, kind, dtype, gen, bits_)


@st.composite
def two_encodings(draw):
    """Keys and values of two token-wise encodings, or one on both sides (bits, groups, scale dtypes drawn per side, head_dims whose
    groups or bytes are no powers of two too), and the launches that write them."""
    head_dim = draw(st.sampled_from([32, 64, 96]))
    groups = [g for g in (8, 12, 16, 24, 32, 48, 64, 96) if head_dim % g == 0]
    encs = tuple(A(draw(st.sampled_from([2, 4, 8])), "token", draw(st.sampled_from(groups)),
                   draw(st.sampled_from(SCALE_DTYPES))) for _ in range(2))
    if draw(st.booleans()):   # one encoding on both sides: one body, the values' tensors and strides selected
        encs = (encs[0], encs[0])
    advance = draw(st.booleans())
    return dict(encs=encs, head_dim=head_dim, advance=advance, per_row=advance or draw(st.booleans()),
                steps=draw(st.lists(st.integers(1, 20), min_size=1, max_size=3 if advance else 1)),
                batch=draw(st.integers(1, 3)), heads=draw(st.integers(1, 3)),
                dtype=draw(st.sampled_from([torch.float16, torch.float32, torch.bfloat16])),
                layouts=draw(st.lists(st.sampled_from(["contiguous", "transposed", "every other token"]), min_size=2,
                                      max_size=2)),
                spare=draw(st.integers(0, 5)), seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=40, deadline=None)
@given(case=two_encodings())
def test_a_pair_launch_of_two_token_wise_encodings_writes_each_as_quantize_does(case):
    """The pair launch with the values in a token-wise encoding of their own (K token:4:128 beside V token:2:128,
    other groups, other scale dtypes): each operand holds foldc.quantize's bits at its rows' offsets, read from
    sources of their own layouts and written into storage of its own strides (views of longer poisoned buffers), and
    nothing else is touched; with ``advance``, launch after launch, every row's offset ends moved on by all the
    launches' tokens (once per launch, whatever the two halves' programs) and the counters are back to zero
    (interpreter, fp16)."""
    from foldc.serving.append import plan_append, run_append

    gen = torch.Generator().manual_seed(case["seed"])
    encs, d, batch, heads, steps = case["encs"], case["head_dim"], case["batch"], case["heads"], case["steps"]
    starts = [int(torch.randint(0, 7, (), generator=gen)) for _ in range(batch)]
    if not case["per_row"]:
        starts = starts[:1] * batch
    capacity = max(starts) + sum(steps) + case["spare"]
    # each operand's storage: the first `capacity` tokens of a buffer of its own length (strides of its own)
    before = [poisoned(enc, batch, heads, capacity + extra, d, gen) for enc, extra in zip(encs, (1, 4))]
    buffers = [AffineTensor(b.codes.clone(), b.scale.clone(), b.zero.clone(), b.encoding, d) for b in before]
    dsts = [AffineTensor(b.codes[:, :, :capacity], b.scale[:, :, :capacity], b.zero[:, :, :capacity], b.encoding, d)
            for b in buffers]
    offsets = torch.tensor(starts, dtype=torch.int32)
    arrivals = torch.zeros(batch, dtype=torch.int32)
    written = [[], []]
    for tokens in steps:
        xs = [_source((batch, heads, tokens, d), layout, case["dtype"], gen, enc.bits)
              for layout, enc in zip(case["layouts"], encs)]
        launch = plan_append(encs[0], heads, d, batch, tokens, case["dtype"] == torch.bfloat16, case["per_row"], 0,
                             False, True, False, encs[1], advance=case["advance"])
        constants = dict(launch.constants)
        # a second encoding compiles a second body; one encoding (SAME2) compiles one
        assert constants["BITS2"] == encs[1].bits and constants["SAME2"] == (encs[0] == encs[1])
        assert launch.grid[0] == 2 * batch * heads
        run_append(launch, dsts[0], xs[0], None if case["per_row"] else starts[0],
                   offsets if case["per_row"] else None, second=(dsts[1], xs[1]),
                   arrivals=arrivals if case["advance"] else None)
        for w, x in zip(written, xs):
            w.append(x)
    for b, buf, w in zip(before, buffers, written):
        assert_same_bits(buf, expected(b, torch.cat(w, dim=2), starts))
    moved = sum(steps) if case["advance"] else 0
    assert offsets.tolist() == [s + moved for s in starts] and arrivals.tolist() == [0] * batch


def _advancing_writes(enc, head_dim, batch, heads, steps, starts, dtype, gen, device="cpu", pair=True):
    """``steps`` (tokens per launch) written one launch after another at each row's own offset by launches planned
    with ``advance=True`` (the offsets moved on by the launches alone) into poisoned storage: (before, after,
    written values per operand, offsets after, arrival counters after). ``pair``: True (K and V of ``enc``), an
    encoding (the values'), or False (one operand)."""
    from foldc.serving.append import plan_append, run_append

    capacity = max(starts) + sum(steps) + 2
    encs = (enc, enc if pair is True else pair) if pair is not False else (enc,)
    ops = len(encs)
    before = [poisoned(e, batch, heads, capacity, head_dim, gen) for e in encs]
    dsts = [AffineTensor(d.codes.clone().to(device), d.scale.clone().to(device), d.zero.clone().to(device), e,
                         head_dim) for d, e in zip(before, encs)]
    offsets = torch.tensor(starts, dtype=torch.int32, device=device)
    arrivals = torch.zeros(batch, dtype=torch.int32, device=device)
    written = [[] for _ in range(ops)]
    for tokens in steps:
        xs = [values((batch, heads, tokens, head_dim), "normal", dtype, gen, e.bits) for e in encs]
        launch = plan_append(enc, heads, head_dim, batch, tokens, dtype == torch.bfloat16, True, 0, False,
                             device == "cpu", False, pair, advance=True)
        run_append(launch, dsts[0], xs[0].to(device), None, offsets,
                   second=(dsts[1], xs[1].to(device)) if ops == 2 else None, arrivals=arrivals)
        for w, x in zip(written, xs):
            w.append(x)
    return before, dsts, [torch.cat(w, dim=2) for w in written], offsets.cpu(), arrivals.cpu()


@settings(max_examples=20, deadline=None)
@given(bits_=st.sampled_from([2, 4, 8]), group=st.sampled_from([16, 32, 64]), batch=st.integers(1, 3),
       heads=st.integers(1, 3), steps=st.lists(st.integers(1, 20), min_size=1, max_size=3), pair=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_advancing_launches_write_at_each_rows_offset_and_move_it_on(bits_, group, batch, heads, steps, pair, seed):
    """Launches planned with ``advance=True`` (the paged cache's decode steps: no ``offsets += 1`` launch of
    their own): launch after launch, every row's tokens land at its own offset with foldc.quantize's bits and
    nothing else touched, every offset ends moved on by all the launches' tokens (several programs per row: heads,
    the pair's two halves, token blocks of 16), and the arrival counters are back to zero (interpreter, fp16)."""
    gen = torch.Generator().manual_seed(seed)
    enc = A(bits_, "token", group)
    starts = [int(torch.randint(0, 7, (), generator=gen)) for _ in range(batch)]
    before, dsts, xs, offsets, arrivals = _advancing_writes(enc, 64, batch, heads, steps, starts, torch.float16,
                                                            gen, pair=pair)
    assert offsets.tolist() == [s + sum(steps) for s in starts]
    assert arrivals.tolist() == [0] * batch
    for b, d, x in zip(before, dsts, xs):
        assert_same_bits(d, expected(b, x, starts))


def test_an_advancing_launch_needs_per_row_offsets_and_token_wise_groups():
    from foldc.serving.append import plan_append

    with pytest.raises(SpecError, match="per_row=True"):
        plan_append(A(4, "token", 32), 2, 64, 1, 1, False, False, 0, False, True, advance=True)
    with pytest.raises(SpecError, match="counts=False"):
        plan_append(A(4, "token", 32), 2, 64, 1, 1, False, True, 16, True, True, advance=True)
    with pytest.raises(SpecError, match="token-wise"):
        plan_append(A(4, "channel", 16), 2, 64, 1, 16, False, True, 0, False, True, advance=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pair", [True, A(2, "token", 128, torch.bfloat16), False],
                         ids=["pair", "pair of two encodings", "one operand"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_advancing_launches_move_every_rows_offset_on_once(pair, dtype):
    """On the GPU, where a row's programs run at once: 40 launches over 64 rows of 8 heads (2 x 8 programs a row
    in pair mode, 16-token blocks on the second axis at 20 tokens), each row's offset moved on by the launch's
    tokens exactly once per launch and every token written where its row's offset said, the counters back to
    zero."""
    gen = torch.Generator().manual_seed(91 + (pair is True))
    enc = A(4, "token", 64)
    steps = [1] * 36 + [20, 3, 1, 1]
    starts = [int(t) for t in torch.randint(0, 50, (64,), generator=gen)]
    before, dsts, xs, offsets, arrivals = _advancing_writes(enc, 128, 64, 8, steps, starts, dtype, gen,
                                                            device="cuda", pair=pair)
    torch.cuda.synchronize()
    assert offsets.tolist() == [s + sum(steps) for s in starts]
    assert arrivals.tolist() == [0] * 64
    for b, d, x in zip(before, dsts, xs):
        got = AffineTensor(d.codes.cpu(), d.scale.cpu(), d.zero.cpu(), b.encoding, 128)
        assert_same_bits(got, expected(b, x, starts))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("enc, enc2", [(A(4, "token", 32), None), (A(2, "token", 128, torch.bfloat16), None),
                                       (A(8, "token", 64, torch.float32), None),
                                       (A(4, "token", 128), A(2, "token", 128)),
                                       (A(2, "token", 32, torch.bfloat16), A(8, "token", 64, torch.float32))],
                         ids=lambda e: e.short() if e else "same")
def test_gpu_pair_launch_writes_keys_and_values_as_quantize_does(enc, enc2, dtype):
    gen = torch.Generator().manual_seed(hash((enc.short(), str(enc2), str(dtype))) % 2**31)
    before, dsts, k, v = _pair_write(enc, 128, 2, 4, 3, 9, 5, dtype, gen, device="cuda", enc2=enc2)
    torch.cuda.synchronize()
    for b, d, x in zip(before, dsts, (k, v)):
        got = AffineTensor(d.codes.cpu(), d.scale.cpu(), d.zero.cpu(), b.encoding, 128)
        assert_same_bits(got, expected(b, x, [5, 5]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enc", [A(4, "token", 32), A(2, "token", 128), A(2, "channel", 16), A(8, "token", 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_appends_write_what_quantize_computes_on_every_repeat_launch(enc, dtype):
    """The append kernel on the GPU, launched again and again at new offsets (the later launches take
    `FastLaunch`'s path to the compiled kernel): every write holds foldc.quantize's bits, and the
    poisoned storage around it is untouched."""
    gen = torch.Generator().manual_seed(hash((enc.short(), str(dtype))) % 2**31)
    batch, heads, head_dim, step = 2, 2, 128, 16 if enc.layout == "channel" else 1
    tokens = 8 * step
    dst = poisoned(enc, batch, heads, tokens, head_dim, gen)
    before = AffineTensor(dst.codes.clone(), dst.scale.clone(), dst.zero.clone(), enc, head_dim)
    dst = AffineTensor(dst.codes.cuda(), dst.scale.cuda(), dst.zero.cuda(), enc, head_dim)
    xs = [values((batch, heads, step, head_dim), "normal", dtype, gen, enc.bits) for _ in range(6)]
    for i, x in enumerate(xs):
        append_quantized(dst, x.cuda(), i * step)
    torch.cuda.synchronize()
    want = foldc.quantize(torch.cat(xs, dim=2), enc)
    n = 6 * step
    rows = n // (enc.group_size if enc.layout == "channel" else 1)
    assert torch.equal(dst.codes[:, :, :n].cpu(), want.codes)
    part = (slice(None), slice(None), slice(0, rows))
    assert torch.equal(bits(dst.scale[part].cpu()), bits(want.scale)) and torch.equal(bits(dst.zero[part].cpu()),
                                                                                        bits(want.zero))
    assert torch.equal(dst.codes[:, :, n:].cpu(), before.codes[:, :, n:])


@pytest.mark.parametrize("target", ["interpret", "reference"])
@pytest.mark.parametrize("part", ["codes", "scale", "zero"])
@pytest.mark.parametrize("append", ["append_quantized", "append_paged"])
def test_storage_whose_elements_share_memory_is_refused(append, part, target):
    """Storage with a part expanded along tokens (stride 0: every token's bytes at one address): the kernel wrote
    each token over the last (the appended tokens read back as copies of one, silently wrong by the values'
    range) and target="reference" raised a RuntimeError from inside torch's copy."""
    gen = torch.Generator().manual_seed(43)
    enc = A(4, "token", 16)
    fresh = poisoned(enc, 2, 2, 16, 32, gen)
    parts = {"codes": fresh.codes, "scale": fresh.scale, "zero": fresh.zero}
    parts[part] = parts[part][:, :, :1].expand(parts[part].shape)
    dst = AffineTensor(parts["codes"], parts["scale"], parts["zero"], enc, 32)
    x = torch.randn(2, 2, 16, 32, generator=gen).half() * 3
    before = [bits(t).clone() for t in (dst.codes, dst.scale, dst.zero)]
    name = "dst" if append == "append_quantized" else "pool"
    with pytest.raises(InputError, match=rf"{name}.{part} has strides \(.*, 0, .*\) for shape .*: some of its "
                                         rf"elements share memory.*{name}.{part}.contiguous\(\)"):
        _append_either(append, dst, x, target)
    for t, old in zip((dst.codes, dst.scale, dst.zero), before):
        assert torch.equal(bits(t), old)   # nothing written
    # the same storage made whole takes the same append and holds exactly what foldc.quantize computes
    whole = AffineTensor(dst.codes.contiguous(), dst.scale.contiguous(), dst.zero.contiguous(), enc, 32)
    append_quantized(whole, x, 0, target=target)
    assert_same_bits(whole, foldc.quantize(x, enc))


def _append_either(append: str, dst, x, target: str) -> None:
    """``append_quantized`` of x at offset 0, or ``append_paged`` of its first 16 tokens as one 16-token page per
    sequence (sequence 0 in page 1, sequence 1 in page 0)."""
    if append == "append_quantized":
        append_quantized(dst, x, 0, target=target)
    else:
        append_paged(dst, x[:, :, :16], torch.tensor([0, 1, 2], dtype=torch.int32),
                     torch.tensor([1, 0], dtype=torch.int32), torch.zeros(2, dtype=torch.int32), page_size=16,
                     target=target)


@pytest.mark.parametrize("target", ["interpret", "reference"])
@pytest.mark.parametrize("pair", ["scale-zero", "codes-scale"])
@pytest.mark.parametrize("append", ["append_quantized", "append_paged"])
def test_storage_whose_parts_share_memory_is_refused(append, pair, target):
    """Storage whose scale and zero are one tensor (``scale = zero = torch.zeros(...)``), or whose codes' bytes
    run into the scales' (views of one buffer carved at the wrong offset): the append wrote the scale and then the
    zero over it (every stored token dequantized to zero * (code + 1), 54x quantize's error, silently)."""
    gen = torch.Generator().manual_seed(44)
    enc = A(4, "token", 16)
    shape = scale_shape(enc, 2, 2, 16, 32)
    if pair == "scale-zero":
        codes, scale = torch.zeros(2, 2, 16, 16, dtype=torch.uint8), torch.zeros(shape, dtype=torch.float16)
        zero = scale
    else:   # an arena whose scale view starts 8 bytes before the codes' end
        arena = torch.zeros(2 * 2 * 16 * 16 + 2 * math.prod(shape) * 2, dtype=torch.uint8)
        n = 2 * 2 * 16 * 16
        codes = arena[:n].view(2, 2, 16, 16)
        scale = arena[n - 8:n - 8 + math.prod(shape) * 2].view(torch.float16).view(shape)
        zero = torch.zeros(shape, dtype=torch.float16)
    dst = AffineTensor(codes, scale, zero, enc, 32)
    x = torch.randn(2, 2, 16, 32, generator=gen).half()
    names = pair.split("-")
    name = "dst" if append == "append_quantized" else "pool"
    with pytest.raises(InputError, match=rf"{name}.{names[0]} and {name}.{names[1]} share memory .* give each part "
                                         rf"its own tensor, e.g. {name}.{names[1]}.clone\(\)"):
        _append_either(append, dst, x, target)


@pytest.mark.parametrize("target", ["interpret", "reference"])
def test_storage_carved_from_one_buffer_without_overlap_is_taken(target):
    """Parts that are views of one buffer but share no element (an arena of codes, then scales, then zeros; scales
    and zeros as the two halves of each row of one tensor) are written as quantize writes separate tensors."""
    gen = torch.Generator().manual_seed(45)
    enc = A(4, "token", 16)
    shape = scale_shape(enc, 2, 2, 16, 32)
    n, m = 2 * 2 * 16 * 16, math.prod(shape) * 2
    arena = torch.zeros(n + 2 * m, dtype=torch.uint8)
    halves = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=torch.float16)
    for dst in (AffineTensor(arena[:n].view(2, 2, 16, 16), arena[n:n + m].view(torch.float16).view(shape),
                             arena[n + m:].view(torch.float16).view(shape), enc, 32),
                AffineTensor(torch.zeros(2, 2, 16, 16, dtype=torch.uint8), halves[..., :shape[-1]],
                             halves[..., shape[-1]:], enc, 32)):
        x = torch.randn(2, 2, 16, 32, generator=gen).half()
        append_quantized(dst, x, 0, target=target)
        assert_same_bits(dst, foldc.quantize(x, enc))
