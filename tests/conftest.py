"""Shared fixtures. The benchmark slices the tests read ship in tests/data (README.md there: their
sources, licences and checksums), so every clone runs the same tests."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

# Tests never reach the Hugging Face hub, and keep the datasets cache out of the home directory.
# (Set before anything imports `datasets`, which reads these at import time.)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", str(Path(tempfile.gettempdir()) / "clipbench-tests-hf-datasets"))

DATA_DIR = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """Slices of the public math benchmarks (tests/data/README.md)."""
    return DATA_DIR


@pytest.fixture(scope="session")
def report_fixture():
    """tests/fixtures/make_report_fixture.py as a module: `.build(root)` writes the fixture results store."""
    path = Path(__file__).parent / "fixtures" / "make_report_fixture.py"
    spec = importlib.util.spec_from_file_location("make_report_fixture", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def unload_plugins():
    """What a test registers (a plugin's rule, correction, aggregation, ...) is unloaded afterwards, in
    every registry and the plugin loader's cache: a later test in the same process (xdist's workers
    take files in any order) sees the registries as shipped."""
    from clipbench import registry

    state = registry.snapshot()
    yield
    registry.restore(state)
