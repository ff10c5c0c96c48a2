"""Loading the nixl backend on a host with a CPU torch does not import torch (plugins/kvxfer_nixl/_nixl.py).

NIXL's meta package imports torch to learn its CUDA version when torch's ``version.py``
already says there is none: about 1 s of every process that used this backend (every peer,
every CLI run). The backend gives that same answer without the import. Each side runs in a
fresh interpreter: the backend's load must leave torch out and pick the very wheel NIXL's own
detection picks; the control, NIXL's own ``import nixl``, does import torch (so the check can
see it), and NIXL's function is back in place afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.nixl]

try:
    import nixl_meta_utils  # noqa: F401
    import torch
except ImportError:  # pragma: no cover - exercised on machines without nixl's meta package or torch
    pytest.skip("needs nixl's meta package and torch", allow_module_level=True)

if torch.version.cuda is not None:  # pragma: no cover - a CUDA torch: NIXL reads it from disk, nothing to spare
    pytest.skip("torch is a CUDA build: NIXL never imports it to choose", allow_module_level=True)

BACKEND = """
import json, sys
import nixl_meta_utils
before = nixl_meta_utils.detect_cuda_major
import kvxfer_nixl._nixl as native
print(json.dumps({"torch": "torch" in sys.modules, "wheel": native.nx.__name__.split(".")[0],
                  "restored": nixl_meta_utils.detect_cuda_major is before}))
"""

# The control: NIXL's own import, as it was before the backend spared it.
NIXL = """
import json, sys
import nixl._api
print(json.dumps({"torch": "torch" in sys.modules, "wheel": nixl._api.__name__.split(".")[0]}))
"""


def _run(code: str) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_the_backend_loads_nixls_own_wheel_without_torch() -> None:
    spared, control = _run(BACKEND), _run(NIXL)
    assert control["torch"] is True, control  # the control: NIXL alone imports torch, and the check sees it
    assert spared == {"torch": False, "wheel": control["wheel"], "restored": True}, (spared, control)
