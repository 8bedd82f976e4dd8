"""A property-based fuzz of foldc's public API.

Every case draws a random layout, shape and lengths, builds a valid call of one entry point, and
then either leaves it valid or swaps one argument for a random bad value. A valid call must give
the right answer (against float64 attention over the dequantized cache, or the documented exact
result); a call with a bad value must raise a `foldc.FoldError`. Any other exception, or a wrong
answer, fails the test (hypothesis shrinks it to the smallest case it can find).

Entry points: `quantize`, `AffineTensor`, `AttentionSpec`/`Affine`, `plan`/`prove`, `compile`
(its options), the compiled callables of the reference and interpreter targets, `merge_attention`,
`attention_reference`, the torch op, `QuantizedKVCache`, `PagedDecodeWrapper`, `PagedKVCache`,
`append_quantized`, the layout-file reader and the CLI. The interpreter cases also hold the fp16
error bar: at most 2x the error of plain fp16 attention over the same values (eq. 6a).

The default run takes a few minutes; CI replays a fixed sequence of cases, other runs draw fresh
ones, and FOLDC_FUZZ_EXAMPLES=N raises every test's case count.
"""
from __future__ import annotations

import contextlib
import io
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import FoldError
from foldc.reference import attention_reference
from foldc.serving import (PagedDecodeWrapper, PagedKVCache, QuantizedKVCache, append_quantized, gather_pages,
                           page_pool)
from foldc.testing import plain_attention, rel_l2

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE = int(os.environ.get("FOLDC_FUZZ_EXAMPLES", "0"))
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def fuzz(examples: int):
    # CI (CI=true) replays one fixed sequence of cases per test, the same on every run; elsewhere
    # every run draws fresh ones (FOLDC_FUZZ_EXAMPLES=N for more)
    return settings(max_examples=max(examples, SCALE), deadline=None, derandomize=os.environ.get("CI") == "true",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# ---- random layouts --------------------------------------------------------------------------

@st.composite
def encodings(draw, head_dim: int):
    if draw(st.integers(0, 5)) == 0:
        return None
    bits = draw(st.sampled_from([2, 4, 8]))
    layout = draw(st.sampled_from(["token", "channel"]))
    if layout == "token":
        group = draw(st.sampled_from([g for g in (8, 16, 32, 64, 128) if head_dim % g == 0]))
    else:
        group = draw(st.sampled_from([16, 32, 64]))
    return foldc.Affine(bits, layout, group, draw(st.sampled_from(SCALE_DTYPES)))


@st.composite
def specs(draw, head_dims=(16, 32, 64)):
    head_dim = draw(st.sampled_from(head_dims))
    kv = draw(st.integers(1, 2))
    ratio = draw(st.sampled_from([1, 2, 3, 4, 5]))
    return foldc.AttentionSpec(kv * ratio, kv, head_dim, k=draw(encodings(head_dim)), v=draw(encodings(head_dim)))


def cache_operand(x: torch.Tensor, enc, dtype: torch.dtype):
    return foldc.quantize(x, enc) if enc is not None else x.to(dtype)


@st.composite
def calls(draw, dtype: torch.dtype, max_tokens: int, max_batch: int = 2, head_dims=(16, 32, 64)):
    """A valid attention call: spec, q, k, v, sm_scale, seq_lens (fresh random data, never zeros)."""
    spec = draw(specs(head_dims))
    batch = draw(st.integers(1, max_batch))
    tokens = draw(st.integers(1, max_tokens))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    offset = draw(st.sampled_from([0.0, 0.5, 4.0]))          # values far from zero too
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen)
    k[..., draw(st.integers(0, spec.head_dim - 1))] *= 6.0   # an outlier key channel
    v = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim, generator=gen) * 2.0 + offset
    lens = None
    if draw(st.booleans()):
        lens = torch.tensor([draw(st.integers(1, tokens)) for _ in range(batch)])
    sm_scale = draw(st.sampled_from([None, 0.05, 0.3, 1]))
    return dict(spec=spec, q=q, k=cache_operand(k, spec.k, dtype), v=cache_operand(v, spec.v, dtype),
                sm_scale=sm_scale, seq_lens=lens)


# ---- random bad values -----------------------------------------------------------------------

def bad_values(c: dict) -> dict:
    """For each argument of an attention call, values it must refuse."""
    spec, q, k = c["spec"], c["q"], c["k"]
    batch, tokens = q.shape[0], k.shape[2]
    other = foldc.Affine(2, "token", 8) if spec.k != foldc.Affine(2, "token", 8) else foldc.Affine(4, "token", 8)
    plain_k = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim).to(q.dtype)
    return {
        "q": [q[..., :-1], q.long(), q.tolist(), q[None], q.to(torch.complex64)],
        "k": [plain_k if spec.k is not None else foldc.quantize(plain_k.float(), other),
              "keys", None, plain_k[:, :, :0]],
        "v": [plain_k[:, :, :max(1, tokens - 1)] if tokens > 1 else plain_k[:, :1, :, :1], 3.0],
        "sm_scale": [math.nan, math.inf, -math.inf, "0.1", [0.1], True, 1j],
        "seq_lens": [torch.zeros(batch, dtype=torch.int64), torch.full((batch,), tokens + 1),
                     torch.full((batch,), -1), torch.ones(batch) * 0.5, torch.ones(batch + 1, dtype=torch.int64),
                     "4", [[1]] * batch, torch.ones(batch, dtype=torch.bool)],
        "out": [torch.empty(batch, spec.num_q_heads, spec.head_dim, dtype=torch.int32), [1],
                torch.empty(batch, spec.num_q_heads, spec.head_dim + 1, dtype=q.dtype),
                torch.empty(batch, spec.num_q_heads, 2 * spec.head_dim, dtype=q.dtype)[..., ::2]],
    }


def _exact(c: dict) -> torch.Tensor:
    return attention_reference(c["q"], c["k"], c["v"], sm_scale=c["sm_scale"], seq_lens=c["seq_lens"])


@fuzz(60)
@given(c=calls(torch.float16, 80, max_batch=3), data=st.data())
def test_reference_target_is_exact_or_refuses(c, data):
    attn = foldc.compile(c["spec"], target="reference", token_tile=data.draw(st.sampled_from([1, 7, 64])))
    args = {name: c[name] for name in ("q", "k", "v", "sm_scale", "seq_lens")}
    corrupt = data.draw(st.sampled_from([None, "q", "k", "v", "sm_scale", "seq_lens", "out"]))
    if corrupt is None:
        out = data.draw(st.sampled_from([None, torch.float64, torch.float32]))
        buf = None if out is None else torch.full(c["q"].shape, math.nan, dtype=out)
        got, lse = attn(**args, out=buf, return_lse=True)
        assert buf is None or got is buf
        assert rel_l2(got, _exact(c)) < (1e-6 if out == torch.float32 else 1e-10)   # out's own rounding
        assert torch.isfinite(lse).all()
    else:
        args[corrupt] = data.draw(st.sampled_from(bad_values(c)[corrupt] if corrupt != "out" else bad_values(c)["out"]))
        with pytest.raises(FoldError):
            attn(**{k: v for k, v in args.items() if k != "out"}, **({"out": args["out"]} if corrupt == "out" else {}))


@fuzz(40)
@given(c=calls(torch.float16, 48, head_dims=(64, 128)), data=st.data())
def test_interpreter_kernel_is_within_the_fp16_bar_or_refuses(c, data):
    """The generated kernel under the interpreter: right answer within 2x plain fp16 attention's
    error over the same dequantized values (eq. 6a), or a FoldError for a bad argument."""
    try:
        attn = foldc.compile(c["spec"], target="interpret")
    except FoldError as e:   # a layout the generated kernel cannot tile: the error says why
        event("layout refused by the interpreter kernel")
        assert "interpret" in str(e) or "tile" in str(e) or "head_dim" in str(e), e
    else:
        args = {name: c[name] for name in ("q", "k", "v", "sm_scale", "seq_lens")}
        corrupt = data.draw(st.sampled_from([None, None, "q", "k", "sm_scale", "seq_lens", "out"]))
        if corrupt is not None:
            bad = data.draw(st.sampled_from(bad_values(c)[corrupt]))
            with pytest.raises(FoldError):
                attn(**(dict(args, out=bad) if corrupt == "out" else dict(args, **{corrupt: bad})))
            event(f"bad {corrupt} refused")
        else:
            got = attn(**args)
            event("kernel output checked")
            exact = _exact(c)
            lens = c["seq_lens"] if c["seq_lens"] is not None else torch.full((c["q"].shape[0],), c["k"].shape[2])
            scale = 1 / math.sqrt(c["spec"].head_dim) if c["sm_scale"] is None else float(c["sm_scale"])
            plain = rel_l2(plain_attention(c["q"], c["k"], c["v"], scale, lens), exact)
            assert rel_l2(got, exact) <= 2 * plain + 1e-4, (c["spec"].describe(), rel_l2(got, exact), plain)


# ---- merge ---------------------------------------------------------------------------------------

@fuzz(60)
@given(c=calls(torch.float32, 60), data=st.data())
def test_merged_parts_equal_attention_over_all_keys(c, data):
    """Split the keys at random cut points, attend to each part (float64 executor), merge: the same
    as one attention over every key; a corrupted part is refused."""
    assume(c["seq_lens"] is None and c["k"].shape[2] >= 2)
    tokens = c["k"].shape[2]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, tokens - 1), min_size=1, max_size=3))))
    bounds = [0, *cuts, tokens]
    spec = c["spec"]
    deq = [x.dequantize(torch.float64) if isinstance(x, foldc.AffineTensor) else x.double() for x in (c["k"], c["v"])]
    plain = foldc.compile(foldc.AttentionSpec(spec.num_q_heads, spec.num_kv_heads, spec.head_dim), "reference")
    parts = [plain(c["q"], deq[0][:, :, a:b], deq[1][:, :, a:b], sm_scale=c["sm_scale"], return_lse=True)
             for a, b in zip(bounds, bounds[1:])]
    how = data.draw(st.sampled_from([None, "nan-lse", "inf-lse", "shape", "dtype", "lse16", "not-a-pair", "empty"]))
    if how is None:
        out, lse = foldc.merge_attention(parts)
        assert rel_l2(out, _exact(c)) < 1e-10
    else:
        o, s = parts[0]
        bad = {"nan-lse": [(o, s.clone().fill_(math.nan))] + parts[1:], "inf-lse": [(o, s.clone().fill_(math.inf))],
               "shape": parts + [(o[..., :-1], s)], "dtype": [(o.long(), s)] + parts[1:], "not-a-pair": [o],
               "lse16": [(o, s.to(data.draw(st.sampled_from([torch.float16, torch.bfloat16]))))] + parts[1:],
               "empty": []}[how]
        with pytest.raises(FoldError):
            foldc.merge_attention(bad)


# ---- quantize and AffineTensor -----------------------------------------------------------------

@fuzz(80)
@given(data=st.data())
def test_quantize_round_trips_within_half_a_step_or_refuses(data):
    head_dim = data.draw(st.sampled_from([8, 16, 48, 64]))
    enc = data.draw(encodings(head_dim).filter(lambda e: e is not None))
    shape = [data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 40)), head_dim]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(shape, generator=gen) * data.draw(st.sampled_from([1e-3, 1.0, 50.0]))
    how = data.draw(st.sampled_from([None, None, "nan", "inf", "empty", "dims", "list", "int", "enc"]))
    if how is not None:
        bad_x, bad_enc = x, enc
        if how in ("nan", "inf"):
            bad_x = x.clone()
            bad_x.view(-1)[data.draw(st.integers(0, x.numel() - 1))] = math.nan if how == "nan" else -math.inf
        elif how == "empty":
            bad_x = x[:, :, :0]
        elif how == "dims":
            bad_x = x[0]
        elif how == "list":
            bad_x = x.tolist()
        elif how == "int":
            bad_x = x.long()
        else:
            bad_enc = "token:2:8"
        with pytest.raises(FoldError):
            foldc.quantize(bad_x, bad_enc)
    else:
        at = foldc.quantize(x, enc)
        s, _ = at.expanded_params(torch.float64)
        err = (at.dequantize(torch.float64) - x.double()).abs()
        # half a step, plus the scale and zero's own rounding into scale_dtype across the group's codes;
        # below fp16's normal range (2^-14) a parameter rounds to a multiple of 2^-24, not relatively
        u = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 2**-24}[enc.scale_dtype]
        floor = 2**-25 * (1 + enc.max_code) if enc.scale_dtype == torch.float16 else 0.0
        bound = s * (0.5 + enc.max_code * u) + x.double().abs() * 2 * u + floor + 1e-30
        assert bool((err <= bound * 1.001).all())
        assert (at.unpack() <= enc.max_code).all() and (at.unpack() >= 0).all()


# ---- specs, plans, compile options, layout files, the CLI ---------------------------------------

BAD_NUMBERS = [0, -1, 3.5, "8", True, None, 10**9]


@fuzz(80)
@given(data=st.data())
def test_spec_and_compile_options_refuse_bad_values(data):
    which = data.draw(st.sampled_from(["bits", "layout", "group", "dtype", "heads", "kv_heads", "head_dim",
                                       "target", "kernel", "block_n", "num_warps", "num_stages", "splits",
                                       "token_tile", "unknown"]))
    bad = data.draw(st.sampled_from(BAD_NUMBERS + ["x", 7]))
    with pytest.raises(FoldError):
        if which in ("bits", "layout", "group", "dtype"):
            args = dict(bits=2, layout="token", group_size=32, scale_dtype=torch.float16)
            key = {"bits": "bits", "layout": "layout", "group": "group_size", "dtype": "scale_dtype"}[which]
            assume(not (key == "bits" and bad in (2, 4, 8)) and not (key == "group_size" and bad in (7, 10**9)))
            args[key] = bad
            foldc.Affine(**args)
        elif which in ("heads", "kv_heads", "head_dim"):
            args = dict(num_q_heads=8, num_kv_heads=2, head_dim=64)
            key = {"heads": "num_q_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim"}[which]
            assume(bad != 7 or key != "head_dim")
            args[key] = bad if bad != 7 else 7   # 7 heads are not a multiple of 2 KV heads / 2 does not divide 7
            foldc.AttentionSpec(**args, k=foldc.Affine(2, "token", 32))
        else:
            spec = foldc.AttentionSpec(8, 2, 64, k=foldc.Affine(2, "token", 32), v=foldc.Affine(2, "channel", 32))
            target = data.draw(st.sampled_from(["reference", "interpret"]))
            if which == "target":
                foldc.compile(spec, target=bad)
            elif which == "unknown":
                foldc.compile(spec, target=target, bogus_option=bad)
            elif which == "token_tile":
                assume(bad not in (7, 10**9))
                foldc.compile(spec, target="reference", token_tile=bad)
            else:
                # reference takes no kernel options at all; the interpreter refuses values it cannot launch
                assume(not (target == "interpret" and which in ("num_stages", "splits") and bad == 7))
                assume(bad is not None and not (which == "splits" and bad == 10**9))
                foldc.compile(spec, target=target, **{which: bad})


TOML_KEYS = ['heads = "8/2"', "head_dim = 64", 'k = "token:2:32"', 'v = "channel:4:32"', 'v = "none"',
             "heads = 5", 'k = "token:3:32"', 'bogus = "x"', "head_dim = -4", 'k = 7', 'head_dim = "64"']


@fuzz(60)
@given(data=st.data())
def test_layout_files_give_a_spec_or_a_fold_error(tmp_path_factory, data):
    lines = data.draw(st.lists(st.sampled_from(TOML_KEYS), max_size=5))
    top = data.draw(st.lists(st.sampled_from(TOML_KEYS[:4] + ["[extra]", "attention = 5"]), max_size=2))
    text = "\n".join(top + ["[attention]"] + lines)
    if data.draw(st.integers(0, 9)) == 0:
        text = text.encode() + b"\xff\xfe"
    path = tmp_path_factory.mktemp("layout") / "layout.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    from foldc.spec import spec_from_toml
    try:
        spec = spec_from_toml(str(path))
    except FoldError as e:   # refused: the message names the file
        assert str(path) in str(e), e
    else:
        # accepted: nothing outside [attention], every key known, each key once, valid values
        assert not top and isinstance(text, str)
        assert isinstance(spec, foldc.AttentionSpec)
        if 'k = "token:2:32"' in lines:
            assert spec.k == foldc.Affine(2, "token", 32)
        foldc.prove(foldc.plan(spec))


CLI_FLAGS = [["--k", "token:2:32"], ["--v", "channel:9:32"], ["--heads", "8/3"], ["--heads", "x"],
             ["--head-dim", "0"], ["--head-dim", "64"], ["--k", "none"], ["--v", "token:4:64:fp32"],
             ["--k", "token:2:48"], ["--heads", "100000/1"]]


@fuzz(40)
@given(data=st.data())
def test_the_cli_exits_cleanly(data):
    """explain/prove with random flags: exit 0 with a plan, or exit 2 with `foldc: error:` and no
    traceback (argparse's own usage errors exit 2 through SystemExit)."""
    from foldc.cli import main

    command = data.draw(st.sampled_from(["explain", "prove"]))
    flags = [f for pair in data.draw(st.lists(st.sampled_from(CLI_FLAGS), max_size=3)) for f in pair]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([command, *flags])
        except SystemExit as e:   # argparse: a flag that is not an integer
            code = e.code
    assert "Traceback" not in err.getvalue()
    assert code in (0, 2)
    if code == 2:
        assert "error" in err.getvalue()
    else:
        assert out.getvalue().strip()


# ---- serving ------------------------------------------------------------------------------------

@st.composite
def cache_specs(draw):
    spec = draw(specs(head_dims=(32, 64)))
    assume(spec.k is not None and spec.v is not None)
    return spec


@fuzz(25)
@given(spec=cache_specs(), data=st.data())
def test_contiguous_cache_matches_float64_or_refuses(spec, data):
    batch = data.draw(st.integers(1, 2))
    sink, window = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 8))
    capacity = data.draw(st.integers(8, 120))
    cache = QuantizedKVCache(spec, batch, capacity, sink=sink, window=window, target="reference")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    for chunk in data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=4)):
        k = torch.randn(batch, spec.num_kv_heads, chunk, spec.head_dim, generator=gen).half()
        v = (torch.randn(batch, spec.num_kv_heads, chunk, spec.head_dim, generator=gen) + 1).half()
        if cache.num_tokens + chunk > capacity:
            with pytest.raises(FoldError):
                cache.append(k, v)
            continue
        cache.append(k, v)
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).half()
    how = data.draw(st.sampled_from([None, "sm_scale", "q", "nan-append"]))
    if cache.num_tokens == 0:
        with pytest.raises(FoldError):
            cache.attention(q)
    else:
        if how is None:
            k, v = cache.dequantized()
            assert rel_l2(cache.attention(q), attention_reference(q, k, v)) < 1e-6   # dequantized() is float32
        elif how == "nan-append":
            before = cache.num_tokens
            bad = torch.randn(batch, spec.num_kv_heads, 1, spec.head_dim).half()
            bad[0, 0, 0, 0] = math.nan
            with pytest.raises(FoldError):
                cache.append(bad, bad)
            assert cache.num_tokens == before
        else:
            with pytest.raises(FoldError):
                if how == "sm_scale":
                    cache.attention(q, sm_scale=data.draw(st.sampled_from([math.nan, "1", math.inf])))
                else:
                    cache.attention(q[..., :-1])


@st.composite
def page_tables(draw, batch: int, num_pages: int, page_size: int):
    """A valid FlashInfer page table and lengths: distinct pages, each sequence at least one token (a test may then
    repeat a page: `PagedDecodeWrapper.plan` takes a prefix of full pages read by several entries)."""
    pages = [draw(st.integers(1, 3)) for _ in range(batch)]
    assume(sum(pages) <= num_pages)
    perm = draw(st.permutations(list(range(num_pages))))[:sum(pages)]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    lens = [draw(st.integers((p - 1) * page_size + 1, p * page_size)) for p in pages]
    return indptr, torch.tensor(perm, dtype=torch.int32), lens


@fuzz(25)
@given(spec=cache_specs(), data=st.data())
def test_paged_wrapper_matches_float64_or_refuses(spec, data):
    page_size = 64 if any(e.layout == "channel" and e.group_size == 64 for e in (spec.k, spec.v)) else 32
    batch, num_pages = data.draw(st.integers(1, 3)), 10
    indptr, indices, lens = data.draw(page_tables(batch, num_pages, page_size))
    w = PagedDecodeWrapper(spec, page_size, max_seq_len=3 * page_size, target="reference")
    how = data.draw(st.sampled_from([None, None, "indptr", "indices", "dup", "lens", "last", "sm_scale", "out",
                                     "pool"]))
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, (indptr[1:] - indptr[:-1]).tolist())],
                        dtype=torch.int32)
    if how == "dup":   # entry 1 names entry 0's page: a shared read where both entries are full pages before
        # their sequences' last tokens (a prefix read twice), else refused (an append could write it)
        assume(indices.numel() >= 2)
        indices = indices.clone()
        indices[1] = indices[0]
        seq = torch.repeat_interleave(torch.arange(batch), indptr[1:] - indptr[:-1])
        ends = [(i - int(indptr[seq[i]]) + 1) * page_size for i in (0, 1)]
        how = None if all(e <= lens[int(seq[i])] for i, e in enumerate(ends)) else "dup"
    if how in ("indptr", "indices", "dup", "lens", "last"):
        bad_indptr, bad_indices, bad_last = indptr, indices, last
        if how == "indptr":
            bad_indptr = indptr.flip(0)
        elif how == "indices":
            bad_indices = indices.clone()
            bad_indices[0] = num_pages
        elif how == "lens":
            bad_last = last.float()
        else:
            bad_last = last + page_size
        with pytest.raises(FoldError):
            w.plan(bad_indptr, bad_indices, bad_last, num_pages=num_pages)
    else:
        w.plan(indptr, indices, last, num_pages=num_pages)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
        pools = {}
        for name in "kv":
            x = torch.randn(num_pages, spec.num_kv_heads, page_size, spec.head_dim, generator=gen)
            pools[name] = foldc.quantize(x, getattr(spec, name))
        q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).half()
        if how is None:
            got = w.run(q, pools["k"], pools["v"])
            kk, _ = gather_pages(pools["k"], indptr, indices, lens, page_size)
            vv, _ = gather_pages(pools["v"], indptr, indices, lens, page_size)
            want = attention_reference(q, kk, vv, seq_lens=torch.tensor(lens))
            assert rel_l2(got, want) < 1e-10
        else:
            with pytest.raises(FoldError):
                if how == "sm_scale":
                    w.run(q, pools["k"], pools["v"], sm_scale=data.draw(st.sampled_from([math.nan, "0.1", [1.0]])))
                elif how == "out":
                    w.run(q, pools["k"], pools["v"], out=torch.empty(q.shape, dtype=torch.int16))
                else:
                    w.run(q, pools["v"] if spec.v != spec.k else page_pool(spec, "k", num_pages + 1, page_size), pools["v"])


@fuzz(15)
@given(spec=cache_specs(), data=st.data())
def test_paged_cache_matches_its_dequantized_contents_or_refuses(spec, data):
    """PagedKVCache (reference target): random prefill and decode steps; attention equals float64
    attention over what the cache holds; lengths claiming tokens it never received are refused."""
    unit = math.lcm(*[e.group_size for e in (spec.k, spec.v) if e.layout == "channel"] or [1])
    page_size = max(32, unit)
    batch = data.draw(st.integers(1, 2))
    cache = PagedKVCache(spec, num_layers=1, page_size=page_size, num_pages=8, max_seq_len=4 * page_size,
                         sink=data.draw(st.integers(0, 2)), window=data.draw(st.integers(0, 4)), target="reference")
    table = (torch.arange(0, 4 * batch + 1, 4, dtype=torch.int32)[:batch + 1], torch.arange(4 * batch, dtype=torch.int32))
    if data.draw(st.booleans()):
        with pytest.raises(FoldError):
            cache.plan(*table, seq_lens=[data.draw(st.integers(1, 3 * page_size))] * batch)
    else:
        cache.plan(*table, seq_lens=[0] * batch)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
        for chunk in data.draw(st.lists(st.integers(1, page_size), min_size=1, max_size=3)):
            k = torch.randn(batch, spec.num_kv_heads, chunk, spec.head_dim, generator=gen).half()
            v = (torch.randn(batch, spec.num_kv_heads, chunk, spec.head_dim, generator=gen) - 2).half()
            if cache.num_tokens(0)[0] + chunk > cache.max_seq_len:
                with pytest.raises(FoldError):
                    cache.append(0, k, v)
                continue
            cache.append(0, k, v)
        q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen).half()
        k, v, lens = cache.dequantized(0)
        want = attention_reference(q, k, v, seq_lens=torch.tensor(lens))
        assert rel_l2(cache.attention(0, q), want) < 2e-3   # the cache returns q's dtype (fp16)


@fuzz(20)
@given(data=st.data())
def test_append_quantized_refuses_what_does_not_fit(data):
    enc = data.draw(encodings(64).filter(lambda e: e is not None))
    cap = 64
    dst = foldc.quantize(torch.randn(1, 2, cap, 64), enc)
    tokens = enc.group_size if enc.layout == "channel" else data.draw(st.integers(1, 8))
    x = torch.randn(1, 2, tokens, 64).half()
    how = data.draw(st.sampled_from(["offset", "negative", "float-offset", "shape", "nan", "dtype", "target"]))
    args = dict(offset=0, target="reference")
    if how == "offset":
        args["offset"] = cap - tokens + 1 if enc.layout == "token" else cap
    elif how == "negative":
        args["offset"] = -1 if enc.layout == "token" else -enc.group_size
    elif how == "float-offset":
        args["offset"] = 1.0
    elif how == "shape":
        x = x[:, :1]
    elif how == "nan":
        x = x.clone()
        x[0, 0, 0, 0] = math.nan
    elif how == "dtype":
        x = x.long()
    else:
        args["target"] = "gpu"
    with pytest.raises(FoldError):
        append_quantized(dst, x, **args)


# ---- the torch op, AffineTensor parts, GEMM -----------------------------------------------------

@fuzz(40)
@given(c=calls(torch.float32, 40, head_dims=(32, 64)), data=st.data())
def test_the_torch_op_matches_float64_or_refuses(c, data):
    """torch.ops.foldc.decode_attention (float32 queries on the CPU: the reference target)."""
    from foldc.ops import attention_op, layout_key

    spec = c["spec"]
    how = data.draw(st.sampled_from([None, "layout", "sm_scale", "scale-missing", "codes-dtype"]))
    if how is None:
        got = attention_op(spec, c["q"], c["k"], c["v"], sm_scale=c["sm_scale"], seq_lens=c["seq_lens"])
        assert rel_l2(got, _exact(c)) < 1e-6   # float32 output
    else:
        parts = lambda x: (x.codes, x.scale, x.zero) if isinstance(x, foldc.AffineTensor) else (x, None, None)  # noqa
        args = [c["q"], *parts(c["k"]), *parts(c["v"]), c["seq_lens"], layout_key(spec), 0.1]
        if how == "layout":
            args[8] = data.draw(st.sampled_from(["", "heads=x", "8/2:64:token:2:128|none", "garbage"]))
        elif how == "sm_scale":
            args[9] = math.nan
        elif how == "scale-missing":
            assume(spec.k is not None)
            args[2] = None
        else:
            assume(spec.k is not None)
            args[1] = args[1].to(torch.int32)
        with pytest.raises(FoldError):
            torch.ops.foldc.decode_attention(*args)


@fuzz(60)
@given(data=st.data())
def test_affine_tensor_refuses_parts_that_do_not_fit(data):
    head_dim = data.draw(st.sampled_from([16, 64]))
    enc = data.draw(encodings(head_dim).filter(lambda e: e is not None))
    good = foldc.quantize(torch.randn(1, 2, 8, head_dim), enc)
    parts = {"codes": good.codes, "scale": good.scale, "zero": good.zero, "encoding": enc, "head_dim": head_dim}
    field = data.draw(st.sampled_from(sorted(parts)))
    bad = {"codes": [good.codes[..., :1], good.codes.int(), good.codes.tolist()],
           "scale": [good.scale[..., :1, :1], good.scale.double(), None],
           "zero": [good.zero.to(torch.float16 if enc.scale_dtype != torch.float16 else torch.float32), "0"],
           "encoding": ["token:2:8", None], "head_dim": [head_dim * 2, 0, -head_dim, True]}[field]
    parts[field] = data.draw(st.sampled_from(bad))
    with pytest.raises(FoldError):
        foldc.AffineTensor(parts["codes"], parts["scale"], parts["zero"], parts["encoding"], parts["head_dim"])


@fuzz(40)
@given(data=st.data())
def test_gemm_specs_and_calls_refuse_bad_values(data):
    from foldc.gemm.reference import gemm_reference, quantize_2d
    from foldc.gemm.spec import GemmEncoding, parse_gemm_encoding

    n, k = data.draw(st.sampled_from([16, 32])), data.draw(st.sampled_from([64, 128]))
    weight = GemmEncoding("k-group", data.draw(st.sampled_from([2, 4, 8])), data.draw(st.sampled_from([32, 64])))
    spec = foldc.GemmSpec(n, k, weight=weight)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(3, k, generator=gen).half()
    w = quantize_2d(torch.randn(n, k, generator=gen), weight)
    how = data.draw(st.sampled_from([None, "n", "bits", "group", "text", "x-shape", "w-plain", "target"]))
    if how is None:
        got = foldc.compile(spec, target="reference")(x, w)
        assert rel_l2(got, gemm_reference(x, w)) < 1e-12
    else:
        with pytest.raises(FoldError):
            if how == "n":
                foldc.GemmSpec(data.draw(st.sampled_from([0, -1, 2.5, "16"])), k, weight=weight)
            elif how == "bits":
                GemmEncoding("k-group", data.draw(st.sampled_from([3, 0, 16])), 32)
            elif how == "group":
                GemmEncoding("k-group", 4, data.draw(st.sampled_from([0, None, -32])))
            elif how == "text":
                parse_gemm_encoding(data.draw(st.sampled_from(["k-group:4", "k-group:x:128", "per-token:4:32", 7])),
                                    "weight")
            elif how == "x-shape":
                foldc.compile(spec, target="reference")(x[:, :-1], w)
            elif how == "w-plain":
                foldc.compile(spec, target="reference")(x, torch.randn(n, k))
            else:
                foldc.compile(spec, target=data.draw(st.sampled_from(["gpu", "sm_80", ""])))
