"""Shared setup of the serving tests: a private kernel cache per test session (the attention
kernels the cache compiles are written there, never to the user's ~/.cache/foldc)."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    old = os.environ.get("FOLDC_CACHE_DIR")
    os.environ["FOLDC_CACHE_DIR"] = str(tmp_path_factory.mktemp("foldc_serving_cache"))
    yield os.environ["FOLDC_CACHE_DIR"]
    if old is None:
        os.environ.pop("FOLDC_CACHE_DIR", None)
    else:
        os.environ["FOLDC_CACHE_DIR"] = old
