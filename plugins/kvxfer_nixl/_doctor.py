"""``kvxfer doctor``'s checks of the nixl backend: NIXL and its UCX plugin, the metadata prover, and
whether its progress thread would fit this machine's cores."""

from __future__ import annotations

import importlib.util
import os

from kvxfer.plugin import install_hint
from kvxfer.plugin.doctor import MARK, Check, check_prover, probe

__all__ = ["checks", "check_nixl", "check_progress_thread"]


_NIXL_PROBE = f"""
import json, importlib.metadata as md
out = {{"version": md.version("nixl")}}
import kvxfer_nixl._nixl  # the backend's UCX workarounds first (plugins/kvxfer_nixl/_nixl.py)
from nixl._api import nixl_agent, nixl_agent_config
a = nixl_agent("kvxfer-doctor", nixl_agent_config(backends=["UCX"]))
out["plugins"] = sorted(a.get_plugin_list())
out["backends"] = sorted(a.backends)
out["mem"] = sorted(a.get_backend_mem_types("UCX")) if "UCX" in a.backends else []
print({MARK!r} + json.dumps(out))
"""


def check_nixl() -> list[Check]:
    if importlib.util.find_spec("nixl") is None:
        return [Check("nixl", "warn", "not installed: the nixl backend is unavailable",
                      install_hint("nixl"))]
    data, err = probe(_NIXL_PROBE, {"NIXL_LOG_LEVEL": "ERROR"})
    if data is None:
        return [Check("nixl", "fail", f"installed, but creating an agent failed: {err}",
                      f"reinstall it ({install_hint('nixl').replace('pip install', 'pip install --force-reinstall', 1)}); if its UCX plugin is missing, "
                      "point NIXL_PLUGIN_DIR at the folder holding libplugin_UCX.so")]
    if "UCX" not in data["backends"]:
        return [Check("nixl", "fail", f"nixl {data['version']} has no UCX backend (plugins: "
                                      f"{', '.join(data['plugins']) or 'none'})",
                      "point NIXL_PLUGIN_DIR at the folder holding libplugin_UCX.so, or reinstall nixl")]
    return [Check("nixl", "ok", f"nixl {data['version']}, UCX backend up; memory {', '.join(data['mem'])}; "
                                f"plugins {', '.join(data['plugins'])}")]


def checks() -> list[Check]:
    return check_nixl() + check_prover("kvxfer_nixl._helper:make_probe", {"backends": ["UCX"]},
                                       needs="nixl") + check_progress_thread()


def check_progress_thread() -> list[Check]:
    """Whether NIXL's spinning progress thread (the ``progress_thread`` option) would fit here."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if usable <= 2:
        # Off by default, so nothing is wrong: say why it should stay off here.
        return [Check("progress thread", "info",
                      f"off (the default), as it should be: NIXL's progress thread busy-spins a whole core, and "
                      f"with {usable} usable core(s) it would starve the threads that move bytes; an agent "
                      "others read from is served by its napping background_progress thread instead "
                      "(measurements: BENCHMARKS.md, NIXL section and \"A passive peer\")")]
    return [Check("progress thread", "ok", f"{usable} cores: one spinning progress thread per agent fits; "
                                           "still off by default (background_progress serves readers)")]
