"""Shared setup of the Triton backend tests: tables shown in pytest's terminal summary (the
private kernel cache comes from tests/conftest.py)."""
from __future__ import annotations

import pytest


_TABLES: list[tuple[str, list[str]]] = []


@pytest.fixture
def report_table():
    """``report_table(title, lines)``: show a table in pytest's terminal summary (no -s needed)."""
    def add(title: str, lines: list[str]) -> None:
        _TABLES.append((title, list(lines)))
    return add


def pytest_terminal_summary(terminalreporter):
    for title, lines in _TABLES:
        terminalreporter.write_sep("-", title)
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def stub_cuda(tmp_path_factory):
    """The stand-in libcuda (tests/backends/_stub_cuda.py) with foldc's C launcher built and loaded against it."""
    from _stub_cuda import build_stub

    from foldc.backends.runtime import fast_c

    stub = build_stub(tmp_path_factory.mktemp("stub_cuda"))
    fast_c._module = fast_c._failed = None   # a try before the stand-in was loaded would have failed
    if fast_c.module() is None:
        pytest.fail(f"foldc's launcher did not build against the stand-in libcuda: {fast_c._failed!r}")
    return stub
