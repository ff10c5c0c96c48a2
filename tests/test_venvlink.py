"""tools/venvlink.py: only byte-equal files are shared, and only inside site-packages."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "venvlink", Path(__file__).resolve().parents[1] / "tools" / "venvlink.py")
assert _spec and _spec.loader
venvlink = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(venvlink)

BIG = venvlink.MIN_BYTES * 2


def _venv(root: Path, name: str) -> Path:
    site = root / name / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    return root / name


def _write(venv: Path, rel: str, data: bytes) -> Path:
    p = venvlink.site_packages(venv) / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def test_dedupe_links_equal_files_and_leaves_different_ones(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    same = rng.integers(0, 256, BIG, dtype=np.uint8).tobytes()
    other = bytearray(same)
    other[-1] ^= 0xFF  # one byte differs at the end: same size, same path
    a, b, c = (_venv(tmp_path, n) for n in ("a", "b", "c"))
    pa, pb, pc = (_write(v, "pkg/lib.so", same) for v in (a, b, c))
    qa = _write(a, "pkg/data.bin", same)
    qb = _write(b, "pkg/data.bin", bytes(other))
    ra = _write(a, "pkg/small.py", b"x" * 100)
    rb = _write(b, "pkg/small.py", b"x" * 100)
    sb, sc = _write(b, "only_bc/t.so", same), _write(c, "only_bc/t.so", same)

    freed = venvlink.dedupe([a, b, c])

    assert os.path.samefile(pa, pb) and os.path.samefile(pa, pc)
    assert os.path.samefile(sb, sc)  # shared by the later venvs only
    assert not os.path.samefile(qa, qb)  # control: one byte differs, both kept
    assert qb.read_bytes() == bytes(other) and qa.read_bytes() == same
    assert not os.path.samefile(ra, rb)  # below MIN_BYTES: not worth a compare
    assert freed == 3 * BIG
    assert pc.read_bytes() == same


def test_link_follows_the_record_and_stays_in_site_packages(tmp_path: Path) -> None:
    src, dst = _venv(tmp_path, "src"), _venv(tmp_path, "dst")
    body = b"\x01" * BIG
    _write(src, "torch/lib/libtorch.so", body)
    _write(src, "torch/__init__.py", b"v = 1\n")
    info = venvlink.site_packages(src) / "torch-2.13.0+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Name: torch\nVersion: 2.13.0+cpu\n")
    outside = tmp_path / "src" / "bin" / "torchrun"
    outside.parent.mkdir()
    outside.write_text("#!/src/python\n")
    (info / "RECORD").write_text(
        "torch/lib/libtorch.so,sha256=x,1\ntorch/__init__.py,,\n"
        "torch-2.13.0+cpu.dist-info/METADATA,,\ntorch-2.13.0+cpu.dist-info/RECORD,,\n"
        "../../../bin/torchrun,,\n/etc/passwd,,\n")

    shared = venvlink.link(src, dst, ["torch"])

    site = venvlink.site_packages(dst)
    assert os.path.samefile(site / "torch/lib/libtorch.so", venvlink.site_packages(src) / "torch/lib/libtorch.so")
    assert (site / "torch-2.13.0+cpu.dist-info" / "METADATA").is_file()
    assert not (tmp_path / "dst" / "bin" / "torchrun").exists()  # the console script's shebang is src's
    assert shared >= BIG
    # A file the destination already has is left alone (pip's or the user's).
    _write(dst, "torch/extra.py", b"mine")
    (info / "RECORD").write_text("torch/extra.py,,\n")
    _write(src, "torch/extra.py", b"theirs")
    venvlink.link(src, dst, ["torch"])
    assert (site / "torch/extra.py").read_bytes() == b"mine"
