"""torch.ops.foldc.decode_attention: matches compile(), passes opcheck, traces under torch.compile."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import FoldError, InputError, SpecError
from foldc.ops import attention_op, layout_key, spec_from_key

SPEC = foldc.AttentionSpec(8, 2, 64, foldc.Affine(2, "token", 32), foldc.Affine(4, "channel", 16))


def _inputs(seed, dtype=torch.float16, spec=SPEC, tokens=50):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, spec.num_q_heads, spec.head_dim, generator=gen).to(dtype)
    k = torch.randn(2, spec.num_kv_heads, tokens, spec.head_dim, generator=gen)
    v = torch.randn(2, spec.num_kv_heads, tokens, spec.head_dim, generator=gen) + 0.5
    kq = foldc.quantize(k, spec.k) if spec.k else k.to(dtype)
    vq = foldc.quantize(v, spec.v) if spec.v else v.to(dtype)
    return q, kq, vq, torch.tensor([tokens, tokens - 13])


def test_import_foldc_registers_every_custom_op():
    """``import foldc`` registered foldc::linear (foldc.nn) but not the ops of foldc/ops.py: the README's
    ``torch.ops.foldc.decode_attention`` after ``import foldc`` raised torch's AttributeError ('_OpNamespace' 'foldc'
    object has no attribute 'decode_attention'), as did loading a traced or exported graph that calls it."""
    import subprocess
    import sys

    code = ("import torch, foldc; print(torch.ops.foldc.decode_attention.default, torch.ops.foldc.append_kv.default, "
            "torch.ops.foldc.linear.default)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["foldc.decode_attention.default", "foldc.append_kv.default", "foldc.linear.default"]


def test_layout_key_round_trips():
    assert layout_key(SPEC) == "8/2/64/token:2:32/channel:4:16"
    assert spec_from_key(layout_key(SPEC)) == SPEC
    plain = foldc.AttentionSpec(4, 4, 32)
    assert spec_from_key(layout_key(plain)) == plain


def test_bad_layout_key_names_the_format():
    with pytest.raises(SpecError, match="Q/KV/head_dim"):
        spec_from_key("8/2/64/token:2:32")


@st.composite
def _specs(draw):
    kv = draw(st.integers(1, 64))
    head_dim = 8 * draw(st.integers(1, 128))

    def enc():
        if draw(st.booleans()):
            return None
        layout = draw(st.sampled_from(["token", "channel"]))
        divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
        group = draw(st.sampled_from(divisors) if layout == "token" else st.integers(1, 2**31 - 1))
        return foldc.Affine(draw(st.sampled_from([2, 4, 8])), layout, group,
                            draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])))

    return foldc.AttentionSpec(kv * draw(st.integers(1, 1024 // kv)), kv, head_dim, enc(), enc())


@settings(max_examples=200, deadline=None)
@given(_specs())
def test_layout_key_round_trips_every_spec(spec):
    """spec -> layout_key -> spec is the identity (scale dtypes, plain operands, the largest groups and heads)."""
    key = layout_key(spec)
    assert spec_from_key(key) == spec and layout_key(spec_from_key(key)) == key


@pytest.mark.parametrize("layout", ["8/2/64//channel:4:16", "8/2/64/token:2:32/", "8/2/64//"])
def test_an_empty_encoding_in_a_layout_key_is_not_a_plain_operand(layout):
    """An empty encoding field (a key joined from an unset value) read as a plain operand: the op then took the
    codes of a quantized cache for values, or attended over a plain cache the caller meant quantized. layout_key
    writes 'none' for a plain operand; an empty field is an error naming it."""
    with pytest.raises(SpecError) as ei:
        spec_from_key(layout)
    assert repr(layout) in str(ei.value) and "'none'" in str(ei.value)


@pytest.mark.parametrize("layout", [123, None, b"8/2/64/none/none", ["8/2/64/none/none"]])
def test_a_layout_key_that_is_no_string_names_the_type(layout):
    """spec_from_key(123) raised AttributeError ('int' object has no attribute 'split'), a list TypeError
    (unhashable type) from its cache."""
    with pytest.raises(SpecError) as ei:
        spec_from_key(layout)
    assert "must be a string" in str(ei.value) and type(layout).__name__ in str(ei.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_op_matches_the_reference(dtype):
    q, k, v, lens = _inputs(1, dtype)
    got = attention_op(SPEC, q, k, v, seq_lens=lens)
    ref = foldc.attention_reference(q, k, v, seq_lens=lens)
    assert got.dtype == dtype and got.shape == q.shape
    assert ((got.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_opcheck():
    q, k, v, lens = _inputs(2, torch.float32)
    args = (q, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, lens, layout_key(SPEC), 0.125)
    torch.library.opcheck(torch.ops.foldc.decode_attention.default, args)


@pytest.mark.parametrize("seed", [5, 6])
def test_a_query_of_other_strides_gets_the_fake_outputs_strides(seed):
    """The fake returned q's strides (empty_like) while the op returns a contiguous tensor: torch.compile
    lays out the op's readers by the fake, and opcheck failed its fake-tensor test on a permuted q."""
    q, k, v, lens = _inputs(seed, torch.float32)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)   # [batch, heads, dim] with batch the middle stride
    assert not q.is_contiguous()
    args = (q, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, lens, layout_key(SPEC), 0.125)
    torch.library.opcheck(torch.ops.foldc.decode_attention.default, args)
    got = attention_op(SPEC, q, k, v, seq_lens=lens.tolist())   # a list of lengths, as compile()'s calls take
    ref = foldc.attention_reference(q, k, v, seq_lens=lens)
    assert got.is_contiguous() and ((got.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_plain_operand_opcheck():
    spec = foldc.AttentionSpec(8, 2, 64, foldc.Affine(2, "token", 32), None)
    q, k, v, lens = _inputs(3, torch.float32, spec)
    args = (q, k.codes, k.scale, k.zero, v, None, None, lens, layout_key(spec), 0.125)
    torch.library.opcheck(torch.ops.foldc.decode_attention.default, args)


def test_traces_under_torch_compile_without_graph_breaks():
    q, k, v, lens = _inputs(4, torch.float32)

    def step(q, kc, ks, kz, vc, vs, vz, lens):
        h = q * 2.0
        out = torch.ops.foldc.decode_attention(h, kc, ks, kz, vc, vs, vz, lens, layout_key(SPEC), 0.125)
        return out + 1.0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    args = (q, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, lens)
    assert torch.allclose(compiled(*args), step(*args))


def _bad_attention_calls(seed):
    """(what, args of torch.ops.foldc.decode_attention) the real op refuses on the CPU, from q, k, v and seq_lens
    that alone it takes."""
    q, k, v, lens = _inputs(seed, torch.float32, tokens=48)
    kv = (k.codes, k.scale, k.zero, v.codes, v.scale, v.zero)
    lk = layout_key(SPEC)
    q16 = q.half()
    plain = foldc.AttentionSpec(8, 2, 64, SPEC.k, None)
    return [
        ("q of another head_dim", (q[..., :32].contiguous(), *kv, lens, lk, 0.125)),
        ("q of rank 4", (q[None], *kv, lens, lk, 0.125)),
        ("an integer q", (q.mul(4).to(torch.int32), *kv, lens, lk, 0.125)),
        ("no sequence", (q[:0], *(t[:0] for t in kv), None, lk, 0.125)),
        ("a NaN sm_scale", (q, *kv, lens, lk, float("nan"))),
        ("no k scale", (q, k.codes, None, k.zero, *kv[3:], lens, lk, 0.125)),
        ("float codes", (q, k.codes.float(), *kv[1:], lens, lk, 0.125)),
        ("a scale of fewer tokens", (q, k.codes, k.scale[:, :, :10], *kv[2:], lens, lk, 0.125)),
        ("float lengths", (q, *kv, lens.float(), lk, 0.125)),
        ("a length per head", (q, *kv, lens.repeat(2), lk, 0.125)),
        ("a plain v in another dtype than an fp16 q", (q16, *kv[:3], v.dequantize(torch.float32), None, None, lens,
                                                        layout_key(plain), 0.125)),
        ("a scale and zero for a v the layout says plain", (q, *kv[:3], v.dequantize(torch.float32), v.scale, v.zero,
                                                            lens, layout_key(plain), 0.125)),
        ("a zero alone for a v the layout says plain", (q, *kv[:3], v.dequantize(torch.float32), None, v.zero,
                                                        lens, layout_key(plain), 0.125)),
        # the kernels (an fp16 q on the CPU: the interpreter) read contiguous caches and q at unit stride
        ("an fp16 q strided along head_dim", (torch.stack([q16, q16], -1)[..., 0], *kv, lens, lk, 0.125)),
        ("a token slice of the cache, fp16 q", (q16, *(t[:, :, :32] for t in kv[:3]), kv[3][:, :, :32],
                                                *(t[:, :, :2] for t in kv[4:]), lens - 16, lk, 0.125)),
        ("a transposed plain v, fp16 q", (q16, *kv[:3], v.dequantize(torch.float16).transpose(2, 3).contiguous()
                                          .transpose(2, 3), None, None, lens, layout_key(plain), 0.125)),
    ]


def _fake_raises_as_the_op(op, args):
    """``op`` on ``args`` raises a FoldError; on fake copies of them its fake raises the same error, same message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(FoldError) as real:
        op(*args)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(type(real.value), match=re.escape(str(real.value))):
            op(*fakes)


@pytest.mark.parametrize("case", range(16))
def test_the_attention_fake_refuses_what_the_op_refuses(case):
    """The fake checked the layout alone: a q of another head_dim, an integer q, a cache of the wrong shape, a NaN
    sm_scale... traced to an output of q's shape and dtype (a q [2, 8, 32] gave a [2, 8, 32] output the graph's
    later ops were traced against) where the op raises. Now the fake raises the op's error, naming the value. So
    it does for a cache or q of strides the kernels refuse (a slice of the cache along tokens, for an fp16 q on the
    CPU): it traced, and the compiled step raised when it ran."""
    _fake_raises_as_the_op(torch.ops.foldc.decode_attention, _bad_attention_calls(case)[case][1])


def test_the_attention_fake_refuses_a_float32_query_on_a_gpu():
    """On a GPU the op runs a kernel, which takes fp16 and bf16 queries: the fake said float32 [2, 8, 64]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, lens = _inputs(12, torch.float32)
    with FakeTensorMode():   # tensors of the real ones' shapes and dtypes on a GPU (a CPU-only torch makes them)
        args = [torch.empty(t.shape, dtype=t.dtype, device="cuda")
                for t in (q, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, lens)]
        with pytest.raises(InputError, match=re.escape("q dtype=torch.float32 is not supported here")):
            torch.ops.foldc.decode_attention(*args, layout_key(SPEC), 0.125)
        out = torch.ops.foldc.decode_attention(args[0].to(torch.bfloat16), *args[1:], layout_key(SPEC), 0.125)
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_cuda


@settings(max_examples=4, deadline=None)
@given(which=st.sampled_from(["q", "k"]), dtype=st.sampled_from([torch.float16, torch.float32]),
       seed=st.integers(0, 2**31 - 1))
def test_a_sparse_query_or_plain_cache_is_refused_by_name(which, dtype, seed):
    """A sparse q or plain k raised from inside torch on the float64 executor's path (RuntimeError: reshape is not
    implemented for sparse tensors; NotImplementedError: storage of SparseTensorImpl) and blamed strides on the
    interpreter's: an InputError naming the layout and to_dense() now."""
    spec = foldc.AttentionSpec(8, 2, 64, None, SPEC.v)
    q, k, v, lens = _inputs(seed, dtype, spec)
    q, k = (q.to_sparse(), k) if which == "q" else (q, k.to_sparse())
    with pytest.raises(InputError, match=rf"{which} is a tensor of layout torch.sparse_coo.*{which}.to_dense\(\)"):
        attention_op(spec, q, k, v, seq_lens=lens)


# ---- foldc::append_kv -------------------------------------------------------------------------

from foldc.encoding import AffineTensor, scale_shape  # noqa: E402
from foldc.errors import InputTypeError  # noqa: E402
from foldc.ops import append_op, encoding_from_key  # noqa: E402

APPEND_ENCODINGS = [foldc.Affine(4, "token", 32), foldc.Affine(2, "channel", 16, torch.bfloat16),
                    foldc.Affine(8, "token", 64, torch.float32)]


def _storage(enc, batch=2, heads=2, tokens=48, head_dim=64, seed=0):
    """Storage full of random bytes, so that a write outside the target region shows up."""
    gen = torch.Generator().manual_seed(seed)
    shape = scale_shape(enc, batch, heads, tokens, head_dim)
    width = torch.finfo(enc.scale_dtype).bits // 8
    numel = int(torch.tensor(shape).prod())

    def noise():
        bits = torch.randint(0, 256, (numel * width,), generator=gen, dtype=torch.uint8).view(enc.scale_dtype)
        return bits.reshape(shape).nan_to_num(0.0, 0.0, 0.0)
    codes = torch.randint(0, 256, (batch, heads, tokens, head_dim // enc.codes_per_byte), generator=gen,
                          dtype=torch.uint8)
    return AffineTensor(codes, noise(), noise(), enc, head_dim)


def _clone(t: AffineTensor) -> AffineTensor:
    return AffineTensor(t.codes.clone(), t.scale.clone(), t.zero.clone(), t.encoding, t.head_dim)


def _same(a: AffineTensor, b: AffineTensor) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("codes", "scale", "zero"))


def test_encoding_key_round_trips():
    for enc in APPEND_ENCODINGS:
        assert encoding_from_key(enc.short()) == enc
    with pytest.raises(SpecError, match="plain operand"):
        encoding_from_key("none")


@pytest.mark.parametrize("enc", APPEND_ENCODINGS, ids=lambda e: e.short())
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_append_op_writes_what_append_quantized_writes(enc, dtype):
    from foldc.serving import append_quantized

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 2, 16, 64, generator=gen) * 3 + 1).to(dtype)
    got, want = _storage(enc), _storage(enc)
    append_op(got, x, 16)
    append_quantized(want, x, 16, target="reference")
    assert _same(got, want)
    # per-row offsets (ragged rows)
    offsets = torch.tensor([0, 32])
    got, want = _storage(enc), _storage(enc)
    append_op(got, x, offsets)
    append_quantized(want, x, offsets, target="reference")
    assert _same(got, want)


def test_append_op_errors_name_the_value():
    enc = APPEND_ENCODINGS[1]  # channel-wise groups of 16
    dst = _storage(enc)
    with pytest.raises(InputError, match="not a multiple of group_size=16"):
        append_op(dst, torch.randn(2, 2, 16, 64).half(), 8)
    with pytest.raises(InputError, match="needs 64 token slots but dst holds 48"):
        append_op(dst, torch.randn(2, 2, 32, 64).half(), 32)
    with pytest.raises(InputTypeError, match="offset=1.5 must be an int"):
        append_op(dst, torch.randn(2, 2, 16, 64).half(), 1.5)
    with pytest.raises(SpecError, match="must look like 'layout:bits:group_size'"):
        torch.ops.foldc.append_kv(dst.codes, dst.scale, dst.zero, torch.randn(2, 2, 16, 64), 0, None, "token:4", True)
    # x's rank or head_dim is what is wrong, not dst's (a 0-d x raised IndexError; another head_dim blamed the codes)
    for x in (torch.tensor(1.5), torch.randn(2, 2, 16, 32).half()):
        with pytest.raises(InputError, match=re.escape(f"x shape={tuple(x.shape)} but dst needs [2, 2, tokens, 64]")):
            append_op(dst, x, 0)


def _bad_appends(seed):
    """(what, args of torch.ops.foldc.append_kv) the op refuses, into token:4:32 storage [2, 2, 48, 64] (or
    channel:2:16 where named), of x and offsets it takes otherwise."""
    enc, chan = APPEND_ENCODINGS[0], APPEND_ENCODINGS[1]
    dst, dst_c = _storage(enc, seed=seed), _storage(chan, seed=seed)
    parts, parts_c = (dst.codes, dst.scale, dst.zero), (dst_c.codes, dst_c.scale, dst_c.zero)
    x = torch.randn(2, 2, 16, 64, generator=torch.Generator().manual_seed(seed))
    key = enc.short()
    return [
        ("x of another head_dim", (*parts, x[..., :32].contiguous(), 16, None, key, True)),
        ("x of one row", (*parts, x[:1], 16, None, key, True)),
        ("an integer x", (*parts, x.mul(4).to(torch.int32), 16, None, key, True)),
        ("a float64 x", (*parts, x.double(), 16, None, key, True)),
        ("an offset past the storage", (*parts, x, 40, None, key, True)),
        ("a negative offset", (*parts, x, -1, None, key, True)),
        ("float offsets", (*parts, x, 0, torch.tensor([0.0, 16.0]), key, False)),
        ("an offset per head", (*parts, x, 0, torch.tensor([0, 16, 32]), key, False)),
        ("float codes", (dst.codes.float(), *parts[1:], x, 16, None, key, True)),
        ("fp32 scales for an fp16 encoding", (dst.codes, dst.scale.float(), dst.zero, x, 16, None, key, True)),
        ("storage of another encoding", (*parts, x, 16, None, "token:2:32", True)),
        ("an offset inside a channel group", (*parts_c, x, 8, None, chan.short(), True)),
        # the kernels (fp16 x on the CPU: the interpreter) write storage of unit stride along its last dim
        ("a scale strided along its last dim, fp16 x", (dst.codes, dst.scale.transpose(2, 3).contiguous()
                                                         .transpose(2, 3), dst.zero, x.half(), 16, None, key, True)),
    ]


@pytest.mark.parametrize("case", range(13))
def test_the_append_fake_refuses_what_the_op_refuses(case):
    """The fake checked the encoding's text alone: an x of another shape or dtype, an offset past the storage,
    storage of another encoding... traced (torch.compile, export) where the op raises. Now the fake raises the
    op's error, naming the value (the offsets' values and x's NaN, which need the data, the op alone checks). So
    it does for storage a kernel cannot write (a scale strided along its last dim, for fp16 x on the CPU): it
    traced, and the compiled step raised when it ran."""
    _fake_raises_as_the_op(torch.ops.foldc.append_kv, _bad_appends(case)[case][1])


@settings(max_examples=10, deadline=None)
@given(start=st.integers(1, 16), seed=st.integers(0, 2**31 - 1))
def test_an_offset_given_with_per_row_offsets_is_refused_not_dropped(start, seed):
    """``offsets`` replaces ``offset``: a start given with them was dropped silently (the tokens landed at
    ``offsets``, not ``offsets + offset``). Refused by name, the real op and its fake alike; with offset 0 the
    op writes where ``offsets + start`` says."""
    enc = APPEND_ENCODINGS[0]
    x = torch.randn(2, 2, 4, 64, generator=torch.Generator().manual_seed(seed))
    dst = _storage(enc, seed=seed)
    before = _clone(dst)
    offsets = torch.tensor([0, 8])
    args = (dst.codes, dst.scale, dst.zero, x, start, offsets, enc.short(), True)
    with pytest.raises(InputError, match=f"offset={start} given with per-row offsets"):
        torch.ops.foldc.append_kv(*args)
    assert _same(dst, before)   # nothing written
    _fake_raises_as_the_op(torch.ops.foldc.append_kv, args)
    got, want = _storage(enc, seed=seed), _storage(enc, seed=seed)
    torch.ops.foldc.append_kv(got.codes, got.scale, got.zero, x, 0, offsets + start, enc.short(), True)
    append_op(want, x, offsets + start)
    assert _same(got, want) and not _same(got, before)


@pytest.mark.parametrize("enc", APPEND_ENCODINGS[:2], ids=lambda e: e.short())
def test_append_opcheck(enc):
    dst = _storage(enc)
    x = torch.randn(2, 2, 16, 64) * 2
    torch.library.opcheck(torch.ops.foldc.append_kv.default,
                          (dst.codes, dst.scale, dst.zero, x, 16, None, enc.short(), True))
    torch.library.opcheck(torch.ops.foldc.append_kv.default,
                          (dst.codes, dst.scale, dst.zero, x, 0, torch.tensor([0, 16]), enc.short(), False))


def test_append_then_attend_traces_under_torch_compile_without_graph_breaks():
    """One compiled decode step: quantize new K/V tokens into the cache, then attend over it. The
    op's declared mutations make the compiled graph write the storage before the attention reads it."""
    spec = SPEC  # K token-wise 2-bit, V channel-wise 4-bit groups of 16
    gen = torch.Generator().manual_seed(6)
    k0 = torch.randn(2, 2, 32, 64, generator=gen)
    v0 = torch.randn(2, 2, 32, 64, generator=gen)
    k_new = torch.randn(2, 2, 16, 64, generator=gen)
    v_new = torch.randn(2, 2, 16, 64, generator=gen)
    q = torch.randn(2, 8, 64, generator=gen)
    layout, ks, vs = layout_key(spec), spec.k.short(), spec.v.short()

    def caches():
        k = foldc.quantize(torch.cat([k0, torch.zeros_like(k_new)], dim=2), spec.k)
        v = foldc.quantize(torch.cat([v0, torch.zeros_like(v_new)], dim=2), spec.v)
        return k, v

    def step(q, kc, ks_, kz, vc, vs_, vz, k_new, v_new, lens):
        torch.ops.foldc.append_kv(kc, ks_, kz, k_new, 32, None, ks, True)
        torch.ops.foldc.append_kv(vc, vs_, vz, v_new, 32, None, vs, True)
        out = torch.ops.foldc.decode_attention(q, kc, ks_, kz, vc, vs_, vz, lens, layout, 0.125)
        return out * 2.0

    lens = torch.tensor([48, 48])
    k_eager, v_eager = caches()
    want = step(q, k_eager.codes, k_eager.scale, k_eager.zero, v_eager.codes, v_eager.scale, v_eager.zero,
                k_new, v_new, lens)
    k_comp, v_comp = caches()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(q, k_comp.codes, k_comp.scale, k_comp.zero, v_comp.codes, v_comp.scale, v_comp.zero,
                   k_new, v_new, lens)
    assert torch.equal(got, want)
    assert _same(k_comp, k_eager) and _same(v_comp, v_eager)  # the storage was written in place
    full = foldc.quantize(torch.cat([k0, k_new], dim=2), spec.k)
    assert _same(k_comp, full)  # token-wise: the whole cache equals quantize of all tokens


@pytest.mark.parametrize("enc", APPEND_ENCODINGS[:2], ids=lambda e: e.short())
@pytest.mark.parametrize("dynamic", [None, True])
def test_an_int_offset_that_changes_between_compiled_calls_traces(enc, dynamic):
    """torch.compile makes an int argument that changes between calls symbolic (automatic dynamic shapes, or
    dynamic=True): the fake refused the SymInt offset ('offset=s6 must be an int'), so a compiled decode loop
    appending at its growing length failed at its second step. Now it traces, and each step writes what the
    eager op writes."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    group = enc.group_size if enc.layout == "channel" else 1
    got, want = _storage(enc, seed=11), _storage(enc, seed=11)
    key = enc.short()

    def step(codes, scale, zero, x, offset):
        torch.ops.foldc.append_kv(codes, scale, zero, x * 2.0, offset, None, key, True)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for offset in (0, group, 2 * group):
        x = torch.randn(2, 2, group, 64, generator=gen) + 0.5
        compiled(got.codes, got.scale, got.zero, x, offset)
        step(want.codes, want.scale, want.zero, x, offset)
        assert _same(got, want)
    with pytest.raises(Exception, match=f"at offset 48 needs {48 + group} token slots but dst holds 48"):
        compiled(got.codes, got.scale, got.zero, torch.randn(2, 2, group, 64, generator=gen), 48)   # (refused)


@settings(max_examples=6, deadline=None)
@given(where=st.sampled_from(["meta", "sparse"]), check=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_per_row_offsets_on_the_meta_device_or_sparse_are_refused_by_name(where, check, seed):
    """Offsets on the meta device or sparse, beside storage and x on the CPU, raised from inside torch's copy of
    them to the storage's device (NotImplementedError: Cannot copy out of meta tensor; RuntimeError: unsupported
    memory format option Contiguous), with check=True or False; page tables and lengths such as these are refused
    by name. Now an InputError naming offset, where it is and the fix, before anything is written; storage, x and
    offsets all on the meta device (a shape-only run) still go through the op's fake."""
    from foldc.serving import append_quantized

    enc = APPEND_ENCODINGS[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, 4, 64, generator=gen) + 1
    dst = _storage(enc, seed=seed)
    before = _clone(dst)
    offsets = torch.tensor([3, 20])
    bad = offsets.to("meta") if where == "meta" else offsets.to_sparse()
    what = "on the meta device" if where == "meta" else "of layout torch.sparse_coo"
    for call in (lambda: append_op(dst, x, bad, check=check),
                 lambda: append_quantized(dst, x, bad, target="reference", check=check)):
        with pytest.raises(InputError, match=f"offset is a tensor {what}, whose values cannot be read"):
            call()
    assert _same(dst, before)   # nothing written
    meta = AffineTensor(dst.codes.to("meta"), dst.scale.to("meta"), dst.zero.to("meta"), enc, 64)
    append_op(meta, x.to("meta"), offsets.to("meta"), check=check)
    append_op(dst, x, offsets, check=check)   # dense offsets on the storage's device: written where they say
    want = _clone(before)
    append_quantized(want, x, offsets, target="reference")
    assert _same(dst, want) and not _same(dst, before)


@settings(max_examples=6, deadline=None)
@given(check=st.booleans(), reference=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_sparse_new_tokens_are_refused_by_name(check, reference, seed):
    """A sparse x raised from inside torch (NotImplementedError: aten::amax on the SparseCPU backend, from the NaN
    check; with check=False from the copy or the launch); attention and foldc.quantize refuse sparse tensors by
    name. Now an InputError naming x's layout and to_dense(), before anything is written."""
    from foldc.serving import append_quantized

    enc = APPEND_ENCODINGS[0]
    x = torch.randn(2, 2, 4, 64, generator=torch.Generator().manual_seed(seed)) + 1
    dst = _storage(enc, seed=seed)
    before = _clone(dst)
    call = (lambda: append_quantized(dst, x.to_sparse(), 8, target="reference", check=check)) if reference else \
        (lambda: append_op(dst, x.to_sparse(), 8, check=check))
    with pytest.raises(InputError, match=r"x is a tensor of layout torch.sparse_coo.*x.to_dense\(\)"):
        call()
    assert _same(dst, before)


@settings(max_examples=6, deadline=None)
@given(side=st.sampled_from(["k", "v"]), missing=st.sampled_from(["scale", "zero", "both"]),
       seed=st.integers(0, 2**31 - 1))
def test_a_missing_scale_or_zero_names_its_operand_and_the_layout(side, missing, seed):
    """A None scale or zero for a side the layout calls encoded (a plain tensor handed to attention_op, or a cache
    whose parameters were not passed) said 'an encoded operand needs its scale and zero tensors (got None)': k's and
    v's alike, with no layout and no fix. Now the message names the missing tensors, the side's encoding and the
    fix, the op's and its fake's alike."""
    q, k, v, lens = _inputs(seed, torch.float32)
    args = {"k": [k.codes, k.scale, k.zero], "v": [v.codes, v.scale, v.zero]}
    for part in (("scale", "zero") if missing == "both" else (missing,)):
        args[side][1 if part == "scale" else 2] = None
    names = " and ".join(f"{side}_{p}" for p in (("scale", "zero") if missing == "both" else (missing,)))
    enc = (SPEC.k if side == "k" else SPEC.v).short()
    call = (q, *args["k"], *args["v"], lens, layout_key(SPEC), 0.125)
    with pytest.raises(SpecError, match=rf"{names} (is|are) None, but the layout says {side} is encoded as {enc}"):
        torch.ops.foldc.decode_attention(*call)
    _fake_raises_as_the_op(torch.ops.foldc.decode_attention, call)
    plain = {"k": k.dequantize(torch.float32), "v": v.dequantize(torch.float32)}[side]
    with pytest.raises(SpecError, match=rf"{side}_scale and {side}_zero are None.*{side}'s codes, scale and zero"):
        attention_op(SPEC, q, plain if side == "k" else k, plain if side == "v" else v, seq_lens=lens)
