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
