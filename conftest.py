"""The checkout stays clean: no test may leave a file or folder in the repository root or in the
directory pytest runs from (the API fuzz once made stores named ``prefill/`` and ``x/`` there,
from hostile relative paths). Lives at the root so that every suite, plugins' too, is guarded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent
#: What pytest, its plugins and Python make there by themselves, and ``build/``: the git-ignored
#: folder where the vLLM end-to-end test keeps its report on purpose (build/vllm-e2e.md).
MAY_APPEAR = frozenset({".pytest_cache", ".hypothesis", ".benchmarks", "__pycache__", ".coverage", "build"})


def new_entries(folder: Path, before: set[str]) -> list[str]:
    """Names in ``folder`` that were not in ``before`` and are not a cache of the tools."""
    return sorted(n for n in os.listdir(folder) if n not in before and n not in MAY_APPEAR)


@pytest.fixture(autouse=True)
def _nothing_left_in_the_checkout() -> Iterator[None]:
    """One ``listdir`` per folder before and after each test, so the test that leaks is named."""
    folders = {ROOT, Path.cwd()}
    before = {f: set(os.listdir(f)) for f in folders}
    yield
    left = [str(f / n) for f in folders for n in new_entries(f, before[f])]
    assert not left, f"the test left {left}: write under tmp_path (or remove what you made)"
