"""The SGLang HiCache tests run only in the venv that has SGLang (``make venv-sglang``).

That venv has sglang without its dependency set and a CPU torch; PyPI's torchvision is
CUDA-linked (an install swaps torch), and SGLang's model configs import it at module level
for image preprocessing no KV page touches, so :mod:`sglang_site` stubs it before SGLang is
imported. Anywhere else this directory is skipped at collection.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # sglang_site, and tests/other_uid.py


def _have_sglang() -> bool:
    """SGLang itself, not this folder (a namespace package named ``sglang`` when ``tests/``
    is on ``sys.path``)."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().parent != HERE


collect_ignore_glob = [] if _have_sglang() else ["*.py"]
