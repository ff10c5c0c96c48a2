"""Share identical files between this checkout's virtualenvs by hard links.

`make test` builds three virtualenvs (the main one, vLLM's and SGLang's). Each used to
carry its own copy of the same CPU torch, and the two engine venvs the same triton, nixl
and transformers: 8.5 GB on disk where 4.5 GB are distinct. A CI machine with less free
disk than that failed in the middle of a `pip install` (ENOSPC). A hard link costs no
space and keeps every path and file where pip and Python expect it; pip's uninstall
only unlinks, so a later upgrade in one venv leaves the others' files alone.

Two commands, standard library only (it runs before any venv has packages):

    python tools/venvlink.py link SRC DST torch    # DST gets SRC's installed torch (before pip
                                                   # would unpack a second copy)
    python tools/venvlink.py dedupe V1 V2 V3       # identical files under site-packages become one

Both fall back to doing nothing for a file that cannot be linked (another file system).
"""

from __future__ import annotations

import argparse
import csv
import filecmp
import os
import re
import sys
from pathlib import Path

# Small files are not worth a read and a compare: 64 KiB and up holds ~all of the bytes.
MIN_BYTES = 64 * 1024


def site_packages(venv: Path) -> Path:
    """The venv's one site-packages folder (lib/pythonX.Y/site-packages)."""
    found = sorted(venv.glob("lib/python*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"venvlink: expected one site-packages under {venv}, found {len(found)}")
    return found[0]


def _dist_info(site: Path, name: str) -> Path:
    norm = re.sub(r"[-_.]+", "_", name).lower()
    hits = [p for p in site.glob("*.dist-info") if p.name.split("-")[0].lower() == norm]
    if len(hits) != 1:
        raise SystemExit(f"venvlink: {name} is not installed once in {site} ({len(hits)} found)")
    return hits[0]


def _link(src: Path, dst: Path) -> bool:
    """Make `dst` a hard link to `src`, atomically; False where the file system refuses."""
    tmp = dst.with_name(dst.name + ".venvlink")
    try:
        os.link(src, tmp)
    except OSError:
        return False
    os.replace(tmp, dst)
    return True


def link(src_venv: Path, dst_venv: Path, names: list[str]) -> int:
    """Hard-link installed distributions from one venv into another, by their RECORD.

    Only files inside site-packages are linked: console scripts carry the source venv's
    interpreter in their first line, and nothing here runs them. Returns bytes shared.
    """
    src_site, dst_site = site_packages(src_venv), site_packages(dst_venv)
    shared = 0
    for name in names:
        info = _dist_info(src_site, name)
        with open(info / "RECORD", newline="") as f:
            rows = [row[0] for row in csv.reader(f) if row]
        for rel in rows:
            if rel.startswith("..") or os.path.isabs(rel):
                continue
            src, dst = src_site / rel, dst_site / rel
            if not src.is_file() or dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            if _link(src, dst):
                shared += src.stat().st_size
    return shared


def dedupe(venvs: list[Path]) -> int:
    """Hard-link files that are byte-equal at the same place in several venvs' site-packages.

    The first venv's file is kept; the same relative path, size and bytes elsewhere become
    links to it. Returns bytes freed.
    """
    sites = [site_packages(v) for v in venvs]
    first, rest = sites[0], sites[1:]
    freed = 0
    for root, _dirs, files in os.walk(first):
        for fname in files:
            src = Path(root) / fname
            st = src.lstat()
            if not src.is_file() or src.is_symlink() or st.st_size < MIN_BYTES:
                continue
            rel = src.relative_to(first)
            for site in rest:
                other = site / rel
                try:
                    ost = other.lstat()
                except FileNotFoundError:
                    continue
                if other.is_symlink() or ost.st_ino == st.st_ino or ost.st_size != st.st_size:
                    continue
                if filecmp.cmp(src, other, shallow=False) and _link(src, other):
                    freed += st.st_size
    # Then the later venvs among themselves (vLLM's and SGLang's triton, say).
    if len(venvs) > 2:
        freed += dedupe(venvs[1:])
    return freed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_link = sub.add_parser("link", help="hard-link installed distributions SRC -> DST")
    p_link.add_argument("src", type=Path)
    p_link.add_argument("dst", type=Path)
    p_link.add_argument("names", nargs="+")
    p_dedupe = sub.add_parser("dedupe", help="hard-link byte-equal files across venvs")
    p_dedupe.add_argument("venvs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "link":
        n = link(args.src, args.dst, args.names)
        print(f"venvlink: {args.dst} shares {n / 1e9:.2f} GB of {', '.join(args.names)} with {args.src}")
    else:
        existing = [v for v in args.venvs if v.is_dir()]
        n = dedupe(existing) if len(existing) > 1 else 0
        print(f"venvlink: {n / 1e9:.2f} GB shared between {', '.join(map(str, existing))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
