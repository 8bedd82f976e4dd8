"""Shared test setup: a private foldc cache directory per test session, so generated kernel
modules and autotuning results never come from (or land in) the user's ~/.cache/foldc."""
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


@pytest.fixture
def gluon_lowers_as(monkeypatch):
    """``gluon_lowers_as(fn)``: the registered register-operand backend answers ``lowerable(spec,
    dtype)`` with ``fn`` for this test (its own rules are tested in tests/backends)."""
    from dataclasses import replace

    from foldc import registry

    def stand_in(fn):
        monkeypatch.setitem(registry._BACKENDS, "gluon", replace(registry.attention_backend("gluon"), lowerable=fn))
    return stand_in
