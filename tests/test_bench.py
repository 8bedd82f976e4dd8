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
