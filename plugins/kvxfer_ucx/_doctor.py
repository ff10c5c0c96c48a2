"""``kvxfer doctor``'s checks of the ucx backend: the libucp loaded, its transports, the stuck-slot skip,
and Yama's ptrace policy for the same-host copy path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

from kvxfer.plugin import install_hint
from kvxfer.plugin.doctor import PROBE_TIMEOUT, Check

__all__ = ["check_ptrace", "check_ucx", "stuck_slot_check", "ucx_transports"]


def _ucx_info(lib: str | None = None) -> tuple[str | None, dict[str, str]]:
    """The ``ucx_info`` matching the libucp kvxfer would load (``lib``), and the environment it needs."""
    if lib:
        libdir = os.path.dirname(os.path.realpath(lib))
        cand = os.path.join(os.path.dirname(libdir), "bin", "ucx_info")
        if os.access(cand, os.X_OK):
            path = os.environ.get("LD_LIBRARY_PATH", "")
            return cand, {"LD_LIBRARY_PATH": libdir + (os.pathsep + path if path else "")}
    return shutil.which("ucx_info"), {}


def ucx_transports(lib: str | None = None) -> tuple[list[str] | None, str, str]:
    """(transports, version, error) as ``ucx_info`` reports them."""
    exe, env = _ucx_info(lib)
    if exe is None:
        return None, "", "ucx_info not found"
    try:
        ver = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                             env={**os.environ, **env})
        dev = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                             env={**os.environ, **env})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, "", str(exc)
    if dev.returncode != 0:
        return None, "", (dev.stderr.strip().splitlines() or ["ucx_info failed"])[-1]
    version = next((ln.split(":", 1)[1].strip() for ln in ver.stdout.splitlines() if "Library version" in ln), "?")
    tls = [m.group(1) for m in re.finditer(r"^#\s*Transport:\s*(\S+)", dev.stdout, re.MULTILINE)]
    return sorted(set(tls)), version, ""


def check_ucx(gpus: int, d: dict[str, Any]) -> list[Check]:
    """The rows for ``d``, the plugin's :func:`kvxfer_ucx.diagnostics` (passed in: this module
    does not import its package back)."""
    lib = d["path"]
    if lib is None:
        return [Check("ucx", "warn", "libucp.so not found: the ucx backend is unavailable",
                      f"{install_hint('ucx')}, or point {d['env']} at a system libucp.so")]
    out = [stuck_slot_check(d)]
    tls, version, err = ucx_transports(lib)
    if tls is None:
        return [Check("ucx", "warn", f"UCX {d['version'] or '?'} at {lib}; cannot list transports: {err}",
                      "install UCX's tools (ucx_info) to see transports; transfers may still work"), *out]
    out.insert(0, Check("ucx", "ok", f"UCX {d['version'] or version} loaded from {lib}; transports: {', '.join(tls)}"))
    want = os.environ.get("UCX_TLS")
    if want:
        out.append(Check("UCX_TLS", "info", f"UCX_TLS={want} limits the transports UCX may pick",
                         "unset UCX_TLS unless you mean to restrict transports"))
    if gpus:
        missing = [t for t in ("cuda_ipc", "cuda_copy") if t not in tls]
        if missing:
            out.append(Check("cuda_ipc", "fail", f"{gpus} GPU(s), but UCX lists no "
                                                 f"{', '.join(missing)}: GPU transfers would bounce through host "
                                                 "memory or fail",
                             "use a UCX built with CUDA (the libucx-cu12 wheel is; a system UCX needs "
                             "--with-cuda), and check that UCX_TLS does not exclude cuda_ipc"))
        else:
            out.append(Check("cuda_ipc", "ok", "cuda_ipc and cuda_copy are available to UCX"))
    else:
        out.append(Check("cuda_ipc", "info", "no GPU visible: cuda_ipc not needed"
                         + (" (UCX lists it)" if "cuda_ipc" in tls else "")))
    return out


def stuck_slot_check(d: dict[str, Any]) -> Check:
    """Whether the ucx backend skips a receive-queue slot a killed peer left (its UCX version decides)."""
    if d["version"] is None:
        return Check("ucx stuck-slot", "warn", f"off: {d['error']}", f"{install_hint('ucx')}")
    if d["stuck_slot_skip"]:
        return Check("ucx stuck-slot", "ok", f"on: UCX {d['version']} is a validated release "
                                                  f"({', '.join(d['validated'])})")
    return Check("ucx stuck-slot", "warn", f"off: UCX {d['version']} is not a validated release "
                                                f"({', '.join(d['validated'])}); a peer killed mid-message can wedge "
                                                "an agent's receive queue for all its peers",
                 f"{install_hint('ucx')} (it pins a validated libucx-cu12)")


def check_ptrace() -> list[Check]:
    """Whether Yama lets the same-host copy path (:mod:`kvxfer_ucx._samehost`) read a peer."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        return [Check("same-host copy", "ok", "no Yama restriction: the ucx backend's process_vm_readv path can run")]
    if scope >= 2:
        return [Check("same-host copy", "warn", f"kernel.yama.ptrace_scope={scope}: the ucx backend cannot use "
                                                "process_vm_readv between processes and falls back to UCX RMA",
                      "sysctl kernel.yama.ptrace_scope=1 (needs root), or accept the slower path")]
    return [Check("same-host copy", "ok", f"kernel.yama.ptrace_scope={scope}: process_vm_readv allowed")]
