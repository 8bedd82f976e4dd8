"""`foldc bench` argument checks (the benchmark itself needs a GPU; it runs on the H200 only)."""
from __future__ import annotations

import pytest

from foldc import bench


def test_kernels_filter_that_matches_no_row_names_the_rows(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--kernels", "INT3 KtVt"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--kernels='INT3 KtVt' matches no row" in err and "fold INT2 KtVt g128" in err


@pytest.mark.parametrize("shapes", ["8by4096", "0x4096", "8x"])
def test_bad_shapes_are_refused(shapes, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--shapes", shapes])
    assert "--shapes=" in capsys.readouterr().err


def test_kernels_filter_takes_an_exact_label_alone():
    assert bench.selects("fold INT2 KtVt g128", "fold INT2 KtVt g128")
    assert not bench.selects("fold INT2 KtVt g128", "fold INT2 KtVt g128 (triton)")
    assert bench.selects("KtVt g128", "fold INT2 KtVt g128 (triton)")


def test_decode_case_gives_the_specs_shapes_and_repeats_with_its_seed(tmp_path):
    """The sweeps' shared inputs (benchmarks/*_sweep.py, ab_kernel.py): fresh normals, quantized
    with each side's own encoding, the same for the same seed."""
    import json

    import torch

    import foldc

    spec = foldc.AttentionSpec(8, 2, 64, foldc.Affine(2, "token", 64), foldc.Affine(4, "channel", 32))
    q, k, v = bench.decode_case(spec, 2, 96, seed=5, device="cpu")
    assert q.shape == (2, 8, 64) and q.dtype == torch.bfloat16 and q.abs().sum() > 0
    assert k.encoding == spec.k and v.encoding == spec.v and k.codes.shape[:3] == (2, 2, 96)
    q2, k2, _ = bench.decode_case(spec, 2, 96, seed=5, device="cpu")
    assert torch.equal(q, q2) and torch.equal(k.codes, k2.codes)
    assert not torch.equal(q, bench.decode_case(spec, 2, 96, seed=6, device="cpu")[0])
    bench.save_rows([{"a": 1}], str(tmp_path / "rows.json"))
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"a": 1}]
