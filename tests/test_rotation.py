"""foldc.rotation: the Hadamard rotation is orthogonal, the fast transform equals the dense matrix,
attention is unchanged by rotating q/K and V (and un-rotating the output), the offline folds into
W_v and W_o reproduce the rotated projections, and bad input is rejected with a named error."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foldc
from foldc.errors import InputError, InputTypeError, SpecError
from foldc.rotation import (Rotation, fold_into_output_projection, fold_into_value_projection, fwht,
                            hadamard_matrix)

F64 = torch.float64
DIMS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("d", DIMS)
def test_hadamard_is_orthogonal_and_symmetric(d):
    h = hadamard_matrix(d)
    assert torch.allclose(h.T @ h, torch.eye(d, dtype=F64), atol=1e-14)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full((d, d), d ** -0.5, dtype=F64))


def test_hadamard_small_case_by_hand():
    expected = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=F64) / 2
    assert torch.equal(hadamard_matrix(4), expected)


@pytest.mark.parametrize("seed", [None, 0, 7])
@pytest.mark.parametrize("d", [8, 128])
def test_rotation_matrix_is_orthogonal(d, seed):
    r = Rotation(d, seed).matrix()
    eye = torch.eye(d, dtype=F64)
    assert torch.allclose(r.T @ r, eye, atol=1e-14) and torch.allclose(r @ r.T, eye, atol=1e-14)


@pytest.mark.parametrize("d", DIMS)
def test_fast_transform_equals_dense_matrix(d):
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(d), dtype=F64)
    assert torch.allclose(fwht(x), x @ hadamard_matrix(d), atol=1e-13)
    assert torch.allclose(fwht(fwht(x)), x, atol=1e-13)  # H is its own inverse


@settings(max_examples=20, deadline=None)
@given(seed=st.one_of(st.none(), st.integers(0, 2**31 - 1)), d=st.sampled_from([2, 16, 64, 128]),
       data_seed=st.integers(0, 2**31 - 1))
def test_rotation_methods_equal_dense_products(seed, d, data_seed):
    rot = Rotation(d, seed)
    r = rot.matrix()
    x = torch.randn(2, 3, d, generator=torch.Generator().manual_seed(data_seed), dtype=F64)
    for f in (rot.rotate_keys, rot.rotate_queries, rot.rotate_values):
        assert torch.allclose(f(x), x @ r, atol=1e-13)
    assert torch.allclose(rot.unrotate_output(x), x @ r.T, atol=1e-13)
    assert torch.allclose(rot.unrotate_output(rot.rotate_values(x)), x, atol=1e-13)


def test_same_seed_same_rotation_and_seeds_differ():
    assert torch.equal(Rotation(64, 5).matrix(), Rotation(64, 5).matrix())
    assert not torch.equal(Rotation(64, 5).matrix(), Rotation(64, 6).matrix())
    assert torch.equal(Rotation(64).matrix(), hadamard_matrix(64))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rot_seed=st.one_of(st.none(), st.integers(0, 1000)),
       batch=st.integers(1, 2), kv_heads=st.integers(1, 3), ratio=st.sampled_from([1, 2, 4]),
       tokens=st.integers(1, 70), d=st.sampled_from([4, 16, 64, 128]))
def test_attention_is_unchanged_by_rotation(seed, rot_seed, batch, kv_heads, ratio, tokens, d):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * ratio, d, generator=gen, dtype=F64) * 2
    k = torch.randn(batch, kv_heads, tokens, d, generator=gen, dtype=F64)
    k[..., 0] *= 15  # an outlier channel
    v = torch.randn(batch, kv_heads, tokens, d, generator=gen, dtype=F64) + 0.5
    rot = Rotation(d, rot_seed)
    exact = foldc.attention_reference(q, k, v)
    rotated = foldc.attention_reference(rot.rotate_queries(q), rot.rotate_keys(k), rot.rotate_values(v))
    assert torch.allclose(rot.unrotate_output(rotated), exact, rtol=1e-11, atol=1e-12)


def test_rotated_output_differs_until_unrotated():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 32, generator=gen, dtype=F64), torch.randn(1, 2, 40, 32, generator=gen, dtype=F64),
               torch.randn(1, 2, 40, 32, generator=gen, dtype=F64))
    rot = Rotation(32, 1)
    out = foldc.attention_reference(rot.rotate_queries(q), rot.rotate_keys(k), rot.rotate_values(v))
    exact = foldc.attention_reference(q, k, v)
    assert (out - exact).abs().max() > 0.1
    assert torch.allclose(out, exact @ rot.matrix(), atol=1e-12)


def test_half_precision_inputs_keep_their_dtype():
    x = torch.randn(4, 128, dtype=torch.float64)
    rot = Rotation(128, 3)
    for dt, tol in ((torch.float16, 5e-3), (torch.bfloat16, 3e-2), (torch.float32, 1e-5)):
        y = rot.rotate_keys(x.to(dt))
        assert y.dtype == dt
        assert torch.allclose(y.double(), x @ rot.matrix(), rtol=tol, atol=tol)


def test_folds_into_value_and_output_projections():
    gen = torch.Generator().manual_seed(0)
    hidden, kv_heads, q_heads, d, tokens = 48, 2, 4, 16, 9
    rot = Rotation(d, 11)
    x = torch.randn(tokens, hidden, generator=gen, dtype=F64)
    w_v = torch.randn(kv_heads * d, hidden, generator=gen, dtype=F64)
    b_v = torch.randn(kv_heads * d, generator=gen, dtype=F64)
    w_v2, b_v2 = fold_into_value_projection(w_v, rot, b_v)
    v = (x @ w_v.T + b_v).reshape(tokens, kv_heads, d)
    assert torch.allclose((x @ w_v2.T + b_v2).reshape(tokens, kv_heads, d), rot.rotate_values(v), atol=1e-12)
    assert fold_into_value_projection(w_v, rot)[1] is None

    w_o = torch.randn(hidden, q_heads * d, generator=gen, dtype=F64)
    o = torch.randn(3, q_heads, d, generator=gen, dtype=F64)
    w_o2 = fold_into_output_projection(w_o, rot)
    assert torch.allclose(rot.rotate_values(o).reshape(3, -1) @ w_o2.T, o.reshape(3, -1) @ w_o.T, atol=1e-12)


def test_end_to_end_with_folded_projections_matches_unrotated_layer():
    """A toy attention layer (no RoPE): rotated K/q at run time, V and output folded offline."""
    gen = torch.Generator().manual_seed(2)
    hidden, q_heads, kv_heads, d, tokens = 32, 4, 2, 16, 12
    ws = {n: torch.randn(h * d, hidden, generator=gen, dtype=F64) for n, h in (("q", q_heads), ("k", kv_heads),
                                                                                   ("v", kv_heads))}
    w_o = torch.randn(hidden, q_heads * d, generator=gen, dtype=F64)
    x = torch.randn(tokens, hidden, generator=gen, dtype=F64)
    rot = Rotation(d, 4)

    def layer(w_v, w_o_, rotate_qk):
        q = (x[-1] @ ws["q"].T).reshape(1, q_heads, d)
        k = (x @ ws["k"].T).reshape(tokens, kv_heads, d).permute(1, 0, 2)[None]
        v = (x @ w_v.T).reshape(tokens, kv_heads, d).permute(1, 0, 2)[None]
        if rotate_qk:
            q, k = rot.rotate_queries(q), rot.rotate_keys(k)
        return foldc.attention_reference(q, k, v).reshape(1, -1) @ w_o_.T

    plain = layer(ws["v"], w_o, False)
    folded = layer(fold_into_value_projection(ws["v"], rot)[0], fold_into_output_projection(w_o, rot), True)
    assert torch.allclose(folded, plain, atol=1e-12)


@pytest.mark.parametrize("bad", [0, 3, 6, 96, 100, -8, 2.0, True, "128"])
def test_bad_head_dim_is_a_spec_error(bad):
    with pytest.raises(SpecError, match="head_dim"):
        Rotation(bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        with pytest.raises(SpecError, match="head_dim"):
            hadamard_matrix(bad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, "float32"])
def test_a_matrix_of_a_dtype_that_cannot_hold_its_entries_is_refused(dtype):
    """Rotation.matrix(torch.int64) truncated every ±1/sqrt(d) entry to 0 (an all-zero "rotation");
    hadamard_matrix(d, torch.int32) returned float32, not the dtype asked for; a string raised inside torch."""
    with pytest.raises(SpecError, match="must be a floating-point torch.dtype"):
        Rotation(16, seed=3).matrix(dtype)
    with pytest.raises(SpecError, match="must be a floating-point torch.dtype"):
        hadamard_matrix(16, dtype)


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_seed_past_the_generators_range_is_a_spec_error(seed):
    with pytest.raises(SpecError, match=r"seed=.* must be an int in \[-2\*\*63, 2\*\*64\)"):
        Rotation(64, seed=seed)
    assert Rotation(64, seed=2**64 - 1).seed == 2**64 - 1


def test_non_power_of_two_message_names_value_and_fix():
    with pytest.raises(SpecError) as err:
        Rotation(96)
    assert "head_dim=96" in str(err.value) and "128" in str(err.value) and "pad" in str(err.value)
    with pytest.raises(SpecError, match="head_dim=12"):
        fwht(torch.zeros(2, 12))


def test_bad_inputs_name_the_operand():
    rot = Rotation(64)
    with pytest.raises(InputError, match=r"k shape=\(2, 32\).*head_dim=64"):
        rot.rotate_keys(torch.zeros(2, 32))
    with pytest.raises(InputError, match="q dtype=torch.int64"):
        rot.rotate_queries(torch.zeros(2, 64, dtype=torch.int64))
    with pytest.raises(InputTypeError, match="v must be a torch.Tensor"):
        rot.rotate_values([0.0] * 64)
    with pytest.raises(InputError, match="o shape"):
        rot.unrotate_output(torch.zeros(64, 3))
    with pytest.raises(SpecError, match="seed"):
        Rotation(64, seed="x")
    with pytest.raises(InputError, match="w_o"):
        fold_into_output_projection(torch.zeros(8, 100), rot)
    with pytest.raises(InputError, match="w_v"):
        fold_into_value_projection(torch.zeros(100, 8), rot)
    with pytest.raises(InputTypeError, match="rotation"):
        fold_into_output_projection(torch.zeros(8, 64), "H")


def test_errors_are_fold_errors():
    with pytest.raises(foldc.FoldError):
        Rotation(10)
    with pytest.raises(ValueError):
        Rotation(64).rotate_keys(torch.zeros(3))


@settings(max_examples=20, deadline=None)
@given(kv_heads=st.integers(1, 4), d=st.sampled_from([4, 16, 64]),
       extra=st.sampled_from(["half", "double", "rows"]), seed=st.integers(0, 2**31 - 1))
def test_a_bias_that_is_not_the_projections_is_refused_with_its_own_message(kv_heads, d, extra, seed):
    """A bias of one head's size was told to 'build the Rotation with head_dim=...' (the rows check's advice, wrong
    for a bias); a bias of two rows [2, out] was folded as if it were one; a bias on another device than w_v reached
    torch's matmul. Now each is an InputError naming bias and w_v's out_features (the meta device stands in for a
    second device here)."""
    gen = torch.Generator().manual_seed(seed)
    rot = Rotation(d, seed % 97)
    w_v = torch.randn(kv_heads * d, 24, generator=gen, dtype=F64)
    good = torch.randn(kv_heads * d, generator=gen, dtype=F64)
    wrong = {"half": good[:good.numel() // 2], "double": torch.cat([good, good]),
             "rows": torch.stack([good, good])}[extra]
    with pytest.raises(InputError, match=rf"bias dtype=torch.float64 shape=.* \[out_features={kv_heads * d}\]"):
        fold_into_value_projection(w_v, rot, wrong)
    with pytest.raises(InputError, match="bias is on meta but w_v is on cpu"):
        fold_into_value_projection(w_v, rot, good.to("meta"))
    with pytest.raises(InputTypeError, match="bias must be a torch.Tensor"):
        fold_into_value_projection(w_v, rot, good.tolist())
    w_new, b_new = fold_into_value_projection(w_v, rot, good)   # the right bias still folds: (b R) per head
    assert torch.allclose(b_new.reshape(kv_heads, d), rot.rotate_values(good.reshape(kv_heads, d)), atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(kv_heads=st.integers(1, 4), d=st.sampled_from([4, 16, 64]), seed=st.integers(0, 2**31 - 1))
def test_folds_into_weights_on_the_meta_device_as_on_a_real_one(kv_heads, d, seed):
    """A model built on the meta device (transformers' and accelerate's init_empty_weights, before its checkpoint
    loads) raised torch's RuntimeError (Tensor.item() cannot be called on meta tensors) from hadamard_matrix's loop,
    which read its bits on the weights' device: hadamard_matrix, Rotation.matrix and both folds. The matrix is
    built on the CPU and moved, so meta weights fold to meta weights of the same shapes and dtypes, and a real
    device's matrix is the CPU's."""
    gen = torch.Generator().manual_seed(seed)
    rot = Rotation(d, seed % 97)
    w_v = torch.randn(kv_heads * d, 24, generator=gen, dtype=torch.float16)
    b_v = torch.randn(kv_heads * d, generator=gen, dtype=torch.float16)
    w_o = torch.randn(24, 2 * kv_heads * d, generator=gen, dtype=torch.bfloat16)
    w_new, b_new = fold_into_value_projection(w_v.to("meta"), rot, b_v.to("meta"))
    o_new = fold_into_output_projection(w_o.to("meta"), rot)
    for got, want in ((w_new, w_v), (b_new, b_v), (o_new, w_o)):
        assert got.is_meta and got.shape == want.shape and got.dtype == want.dtype
    assert hadamard_matrix(d, F64, "meta").shape == (d, d) and rot.matrix(torch.float32, "meta").is_meta
    assert torch.equal(hadamard_matrix(d, F64, torch.device("cpu")), hadamard_matrix(d))
    w_cpu, b_cpu = fold_into_value_projection(w_v, rot, b_v)   # the real weights still fold: R^T per head's rows
    want = torch.einsum("ji,hjc->hic", rot.matrix(), w_v.double().reshape(kv_heads, d, 24)).reshape(w_v.shape)
    assert torch.allclose(w_cpu.double(), want, atol=1e-2)


def test_numpy_and_0_dim_torch_integers_are_the_ints_they_hold():
    """Rotation(np.int64(128)) was refused as 'head_dim=np.int64(128) must be a positive integer' (AttentionSpec
    takes it as 128); a NumPy seed likewise."""
    import numpy as np

    r = Rotation(np.int64(16), seed=np.int64(3))
    assert r.head_dim == 16 and type(r.head_dim) is int and r.seed == 3 and type(r.seed) is int
    assert torch.equal(r.matrix(), Rotation(16, seed=3).matrix())
    assert Rotation(torch.tensor(8)).head_dim == 8
    assert torch.equal(hadamard_matrix(np.int64(4)), hadamard_matrix(4))
    with pytest.raises(SpecError, match=r"head_dim=12 is not a power of two"):
        Rotation(np.int64(12))
