"""foldc/options.py: the launch-option rules shared by foldc.compile, the launchers, the AOT
builders and `foldc compile`. Every rule gets a case that breaks it; the Python API raises the
same errors as the CLI, before planning or compiling anything."""
from __future__ import annotations


import pytest

import foldc
from foldc.backends.triton.aot import compile_aot
from foldc.backends.triton.gemm_aot import compile_gemm_aot
from foldc.errors import FoldError, SpecError
from foldc.gemm.spec import gemm_spec_from_table
from foldc.options import (attention_kernel, check_block_n, check_gemm_options, check_launch_options,
                           check_num_stages, check_num_warps, check_out_dir, check_splits, check_stages,
                           cli_launch_options)

A = foldc.Affine
SPEC = foldc.AttentionSpec(8, 2, 64, A(2, "token", 32), A(4, "channel", 32))
GEMM = gemm_spec_from_table({"n": 64, "k": 128, "weight": "k-group:4:32"})


def _raises(call, *fragments):
    with pytest.raises(SpecError) as info:
        call()
    assert isinstance(info.value, FoldError)
    for frag in fragments:
        assert frag in str(info.value), f"{frag!r} missing from {info.value}"
    return str(info.value)


# -- per-option checkers ---------------------------------------------------------------------

@pytest.mark.parametrize("value", [16, 32, 64, 128, 256])
def test_block_n_in_range_passes(value):
    assert check_block_n(value) == value


@pytest.mark.parametrize("value", [0, 8, 24, 512, 1048576, True, 64.0, "64"])
def test_block_n_out_of_range(value):
    _raises(lambda: check_block_n(value), f"block_n={value!r}", "power of two >= 16 and <= 256")


@pytest.mark.parametrize("value", [16, 128, 0, True, 64.0, 32.0])
def test_gluon_block_n_is_32_or_64(value):
    _raises(lambda: check_block_n(value, "gluon"), f"block_n={value!r}", "32 or 64", "kernel='triton'")


@pytest.mark.parametrize("value", [0, 3, 6, 64, True, 4.0])
def test_num_warps_out_of_range(value):
    _raises(lambda: check_num_warps(value), f"num_warps={value!r}", "power of two >= 1 and <= 32", "1024 threads")


@pytest.mark.parametrize("value", [0, -1, 9, True, 2.5])
def test_num_stages_out_of_range(value):
    _raises(lambda: check_num_stages(value), f"num_stages={value!r}", "positive integer <= 8")


@pytest.mark.parametrize("value", [1, 5, 0, True, 3.0])
def test_gluon_stages(value):
    _raises(lambda: check_stages(value), f"stages={value!r}", "2, 3 or 4")


def test_gluon_integer_options_take_numpy_integers_as_ints():
    """A NumPy integer (a sweep over np.arange) is an integer; the checkers hand the kernel a Python int."""
    np = pytest.importorskip("numpy")
    for value in (32, 64):
        got = check_block_n(np.int64(value), "gluon")
        assert got == value and type(got) is int
    for value in (2, 3, 4):
        got = check_stages(np.int32(value))
        assert got == value and type(got) is int


@pytest.mark.parametrize("value", [0, -3, False, 1.5])
def test_splits(value):
    _raises(lambda: check_splits(value), f"splits={value!r}", "positive integer")


def test_none_means_default_everywhere():
    assert [f(None) for f in (check_block_n, check_num_warps, check_num_stages, check_splits, check_stages)] == \
        [None] * 5
    assert check_launch_options("interpret", "triton", block_n=None, num_warps=None) == {}


def test_in_range_values_come_back():
    assert check_launch_options("sm_90", "triton", block_n=32, num_warps=32, num_stages=8, splits=3) == \
        {"block_n": 32, "num_warps": 32, "num_stages": 8, "splits": 3}


# -- options the kernel or target does not use ------------------------------------------------

@pytest.mark.parametrize("option,value", [("block_n", 64), ("num_warps", 4), ("num_stages", 2)])
def test_reference_target_takes_no_launch_option(option, value):
    _raises(lambda: check_launch_options("reference", "triton", **{option: value}), f"{option}={value!r}",
            "target='reference'", "drop")


def test_register_operand_kernel_takes_no_num_warps():
    _raises(lambda: check_launch_options("sm_90", "gluon", num_warps=4), "num_warps=4", "one warp per program",
            "--kernel triton")


def test_register_operand_kernel_takes_stages_not_num_stages():
    _raises(lambda: check_launch_options("sm_90", "gluon", num_stages=2), "num_stages=2", "stages=2, 3 or 4")


def test_unknown_kernel():
    _raises(lambda: check_launch_options("sm_90", "cutlass", block_n=64), "kernel='cutlass'")


@pytest.mark.parametrize("option,value,fragment", [
    ("block_m", 24, "block_m=24 must be a power of two >= 16"), ("block_n", 512, "block_n=512"),
    ("block_k", 8, "block_k=8"), ("split_k", 65, "split_k=65 must be a positive integer <= 64"),
    ("num_warps", 3, "num_warps=3"), ("num_stages", 0, "num_stages=0"), ("block_x", 16, "['block_x']")])
def test_gemm_options(option, value, fragment):
    _raises(lambda: check_gemm_options(**{option: value}), fragment)


def test_attention_kernel_choice_without_a_gpu_target():
    assert attention_kernel(SPEC, "interpret") == "triton"
    _raises(lambda: attention_kernel(SPEC, "interpret", "gluon"), "kernel='gluon'", "target='interpret'")
    _raises(lambda: attention_kernel(SPEC, "interpret", "cuda"), "kernel='cuda'")


def test_sm_100_takes_the_register_operand_kernel_as_sm_90_does():
    """B200 keeps mma.sync: the same lowering rules on both targets (``dequant``: token-wise groups of
    32 channels shared by 16 query rows, a plan the break-even makes dequant, which the register
    operands rebuild per value; ``refused``: token-wise groups of 16 channels, smaller than the value operand's
    eight lane rows of words, which they do not lower)."""
    lowered = foldc.AttentionSpec(32, 8, 128, A(4, "token", 128), A(2, "channel", 64))
    dequant = foldc.AttentionSpec(64, 4, 128, A(2, "token", 32), A(2, "token", 128))
    refused = foldc.AttentionSpec(32, 8, 128, A(2, "token", 16), A(2, "token", 16))
    for target in ("sm_90", "sm_100"):
        assert attention_kernel(lowered, target, "auto") == "gluon"
        assert attention_kernel(SPEC, target, "auto") == "gluon"   # head_dim 64 at 2 bits: four words per token
        assert attention_kernel(dequant, target, "auto") == "gluon"
        assert attention_kernel(refused, target, "auto") == "triton"
        _raises(lambda: attention_kernel(refused, target, "gluon"), "kernel='gluon'", "token-wise groups of 16 channels")


@pytest.fixture
def lowers(gluon_lowers_as):
    """The register-operand kernel lowers every plan (its own rules are tested in tests/backends)."""
    gluon_lowers_as(lambda spec, dtype="bf16": (True, ""))


def test_attention_kernel_auto_on_sm_90_follows_the_options(lowers):
    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "token", 128))
    assert attention_kernel(spec, "sm_90") == "gluon"
    assert attention_kernel(spec, "sm_90", options={"num_warps": 4}) == "triton"
    assert attention_kernel(spec, "sm_90", options={"block_n": 128}) == "triton"
    assert attention_kernel(spec, "sm_100", "gluon", aot=True) == "gluon"


def test_attention_kernel_gluon_says_why_it_cannot(gluon_lowers_as):
    gluon_lowers_as(lambda spec, dtype="bf16": (False, "a reason"))
    assert attention_kernel(SPEC, "sm_90") == "triton"
    _raises(lambda: attention_kernel(SPEC, "sm_90", "gluon"), "kernel='gluon'", "a reason", "'triton'")


def test_cli_options_map_flags_to_the_kernel_that_runs(lowers):
    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "token", 128))
    assert cli_launch_options(spec, "sm_90", "auto", block_n=64, num_stages=3) == ("gluon", {"block_n": 64,
                                                                                           "stages": 3})
    assert cli_launch_options(spec, "sm_90", "triton", num_stages=1) == ("triton", {"num_stages": 1})
    assert cli_launch_options(spec, "reference") == (None, {})
    assert cli_launch_options(GEMM, "interpret", num_warps=2) == ("gemm", {"num_warps": 2})


def test_cli_auto_gluon_rejects_stages_it_cannot_run(lowers):
    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "token", 128))
    _raises(lambda: cli_launch_options(spec, "sm_90", "auto", num_stages=1), "num_stages=1 (--num-stages)",
            "--kernel auto picks the register-operand kernel", "--kernel triton")


def test_cli_gemm_rejects_attention_flags():
    _raises(lambda: cli_launch_options(GEMM, "sm_90", block_n=64), "block_n=64 (--block-n)", "drop --block-n")
    _raises(lambda: cli_launch_options(GEMM, "sm_90", "gluon"), "kernel='gluon'", "drop --kernel")


def test_cli_reference_rejects_a_kernel_choice():
    _raises(lambda: cli_launch_options(SPEC, "reference", "triton"), "kernel='triton' (--kernel)", "drop --kernel")


# -- output folders --------------------------------------------------------------------------

def test_out_dir_is_created(tmp_path):
    assert check_out_dir(tmp_path / "a" / "b").is_dir()


def test_out_dir_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("x")
    _raises(lambda: check_out_dir(tmp_path / "file" / "sub"), f"out={str(tmp_path / 'file' / 'sub')!r}",
            "not a writable folder")


def test_out_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    _raises(lambda: check_out_dir(tmp_path / "file"), "not a writable folder")


def test_out_dir_missing():
    _raises(lambda: check_out_dir(None), "out=None", "--out DIR")


# -- the Python API raises the same errors, before building anything ---------------------------

@pytest.mark.parametrize("options,fragments", [
    ({"block_n": 0}, ["block_n=0", "power of two"]),
    ({"block_n": 1048576}, ["block_n=1048576", "<= 256"]),
    ({"num_warps": 64}, ["num_warps=64", "<= 32"]),
    ({"num_stages": 9}, ["num_stages=9", "<= 8"]),
    ({"splits": True}, ["splits=True", "positive integer"]),
    ({"kernel": "cuda"}, ["kernel='cuda'"]),
    ({"kernel": "gluon"}, ["kernel='gluon'", "target='sm_90'"]),
])
def test_compile_interpret_rejects_bad_options(options, fragments):
    _raises(lambda: foldc.compile(SPEC, "interpret", **options), *fragments)


def test_compile_reference_rejects_launch_options():
    _raises(lambda: foldc.compile(SPEC, "reference", num_warps=4), "['num_warps']", "target='reference'")


def test_compile_gemm_rejects_bad_options():
    _raises(lambda: foldc.compile(GEMM, "interpret", num_warps=3), "num_warps=3")
    _raises(lambda: foldc.compile(GEMM, "interpret", split_k=0), "split_k=0")
    _raises(lambda: foldc.compile(GEMM, "reference", num_warps=4), "target='reference'")


@pytest.mark.parametrize("options,fragment", [
    ({"num_warps": 3}, "num_warps=3"), ({"num_warps": 64}, "num_warps=64"), ({"block_n": 1048576}, "block_n=1048576"),
    ({"num_stages": 0}, "num_stages=0"), ({"block_n": None}, "block_n=None, num_warps=4")])
def test_aot_rejects_bad_options_before_writing(tmp_path, options, fragment):
    _raises(lambda: compile_aot(SPEC, "sm_100", tmp_path / "out", **options), fragment)
    assert not (tmp_path / "out").exists()


def test_aot_rejects_an_unwritable_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (tmp_path / "file").write_text("x")
    _raises(lambda: compile_aot(SPEC, "sm_90", tmp_path / "file" / "out"), "not a writable folder")


@pytest.mark.parametrize("options,fragment", [
    ({"num_warps": 3}, "num_warps=3"), ({"block_n": 8}, "block_n=8"), ({"split_k": 100}, "split_k=100"),
    ({"m": 0}, "m=0"), ({"dtype": "fp32"}, "dtype='fp32'")])
def test_gemm_aot_rejects_bad_options(tmp_path, options, fragment):
    _raises(lambda: compile_gemm_aot(GEMM, "sm_90", tmp_path / "out", **options), fragment)
    assert not (tmp_path / "out").exists()


def test_gluon_aot_rejects_bad_options(tmp_path):
    from foldc.backends.gluon.aot import compile_gluon_aot

    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "token", 128))
    _raises(lambda: compile_gluon_aot(spec, "sm_90", tmp_path / "out", block_n=128), "block_n=128", "32 or 64")
    _raises(lambda: compile_gluon_aot(spec, "sm_90", tmp_path / "out", stages=0), "stages=0", "2, 3 or 4")
    assert not (tmp_path / "out").exists()


def test_gluon_launcher_rejects_zero_instead_of_defaulting():
    from foldc.backends.gluon import GluonAttention

    spec = foldc.AttentionSpec(32, 8, 128, A(2, "token", 128), A(2, "token", 128))
    _raises(lambda: GluonAttention(spec, block_n=0), "block_n=0", "32 or 64")
    _raises(lambda: GluonAttention(spec, stages=0), "stages=0", "2, 3 or 4")
    _raises(lambda: GluonAttention(spec, splits=0), "splits=0", "positive integer")
