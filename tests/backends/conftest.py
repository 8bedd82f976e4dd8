"""Shared setup of the Triton backend tests: a private kernel cache per test session, so the
generated modules these tests import never come from (or land in) the user's ~/.cache/foldc."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    old = os.environ.get("FOLDC_CACHE_DIR")
    os.environ["FOLDC_CACHE_DIR"] = str(tmp_path_factory.mktemp("foldc_cache"))
    yield os.environ["FOLDC_CACHE_DIR"]
    if old is None:
        os.environ.pop("FOLDC_CACHE_DIR", None)
    else:
        os.environ["FOLDC_CACHE_DIR"] = old


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
