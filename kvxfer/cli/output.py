"""How commands print: a table for people, or JSON on an untouched stdout for programs."""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from typing import IO, Any, Iterator

from ..table import dumps

__all__ = ["CliError", "json_stdout", "emit_json", "check_memory", "cuda_devices", "require_cuda"]


class CliError(Exception):
    """Bad input noticed after parsing (an unknown preset, an impossible option mix)."""


_json_out: list[IO[str]] = []


@contextlib.contextmanager
def json_stdout(active: bool) -> Iterator[None]:
    """While a ``--json`` command runs, anything else written to stdout goes to stderr.

    Transport libraries print banners and log lines on file descriptor 1 (NIXL does); with
    fd 1 pointed at stderr for the duration, stdout carries exactly one JSON document.
    """
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    real = os.fdopen(saved, "w", closefd=True)
    os.dup2(2, 1)
    old_stdout = sys.stdout
    sys.stdout = sys.stderr
    _json_out.append(real)
    try:
        yield
    finally:
        _json_out.pop()
        sys.stdout.flush()
        sys.stdout = old_stdout
        os.dup2(saved, 1)
        real.close()


def emit_json(data: Any) -> None:
    out = _json_out[-1] if _json_out else sys.stdout
    out.write(dumps(data) + "\n")
    out.flush()


def check_memory(nbytes: int, what: str) -> None:
    """Refuse a run whose host buffers would not fit in available memory (Linux; else no check)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    if nbytes > 0.8 * available:
        raise CliError(f"{what} needs about {nbytes / 1e9:.1f} GB of host memory and {available / 1e9:.1f} GB is "
                       "available; pass a smaller --tokens or a smaller model")


def cuda_devices() -> int:
    """GPUs torch sees; 0 without importing torch on machines that have no NVIDIA device node."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except (RuntimeError, AssertionError):  # a CPU-only torch build
        return 0


def require_cuda(option: str) -> int:
    """The GPUs torch sees, or a one-line refusal of ``option`` that says what is missing."""
    n = cuda_devices()
    if n:
        return n
    if not glob.glob("/dev/nvidia[0-9]*"):
        why = "this machine has no NVIDIA device"
    else:
        try:
            import torch  # noqa: F401
            why = "torch sees no CUDA device (a CPU-only torch build, or CUDA_VISIBLE_DEVICES hides them)"
        except ImportError:
            why = "torch is not installed (pip install torch: a CUDA build, PyPI's default)"
    raise CliError(f"{option} needs a CUDA device that torch can see: {why}; use --memory DRAM")
