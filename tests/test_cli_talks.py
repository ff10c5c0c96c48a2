"""The command line talks: progress on stderr, one-line errors, one unit syntax, options in any
position, failing exits for refused plans, help for every option, and a doctor whose advice
the CLI accepts. Each error path is run through the installed entry point."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import numpy as np
import pytest

import kvxfer
from kvxfer.cli.app import build_parser
from kvxfer.cli.output import cuda_devices
from test_cli import assert_one_line_error, kvxfer_cmd


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    ap = build_parser()
    action = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help() -> None:
    missing = [f"{name} {a.option_strings}" for name, p in _subparsers().items() for a in p._actions
               if not a.help or a.help == argparse.SUPPRESS]
    assert not missing


@pytest.mark.parametrize("argv,attr", [(["plan", "--tokens", "1k"], "tokens"), (["demo", "--tokens", "16k"], "tokens"),
                                       (["bench", "--tokens", "1k,4K"], "tokens"), (["bench", "--repeat", "2"], "repeat")])
def test_k_units_everywhere(argv: list[str], attr: str) -> None:
    v = getattr(build_parser().parse_args(argv), attr)
    n = {"1k": 1024, "16k": 16384, "1k,4K": [1024, 4096], "2": 2}[argv[-1]]
    assert v == n


def test_bad_unit_is_one_line() -> None:
    assert_one_line_error(kvxfer_cmd("plan", "--tokens", "1.5k"), "--tokens", "4k")


@pytest.mark.parametrize("argv,level", [(["-v", "backends"], 1), (["backends", "-v"], 1), (["backends", "-vv"], 2),
                                        (["-v", "plan", "-v"], 1), (["plan"], 0)])
def test_global_options_in_any_position(argv: list[str], level: int) -> None:
    assert build_parser().parse_args(argv).verbose == level


def test_verbose_after_the_command_logs_lifecycle() -> None:
    r = kvxfer_cmd("bench", "--tokens", "256", "--repeat", "1", "--layouts", "packed:packed", "--json", "-v")
    rows = json.loads(r.stdout)  # --json stays clean: logs and progress go to stderr
    assert rows[0]["verified"] == 2
    assert re.search(r"INFO kvxfer.agent: agent 'local' added peer 'remote' .* pairing whole-row", r.stderr)
    assert "INFO kvxfer.agent: agent 'remote' registered" in r.stderr


def test_progress_goes_to_stderr_and_json_stays_clean() -> None:
    r = kvxfer_cmd("bench", "--tokens", "256,1k", "--repeat", "1", "--json", KVXFER_PROGRESS_AFTER="0")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 4
    for step in ("allocating the remote cache", "packed:packed 1,024 tokens, warm-up: transfer",
                 "layers:packed 256 tokens, run 1/1: verifying 4 blocks", "layers:packed 256 tokens, 2 runs"):
        assert f"kvxfer bench: {step}" in r.stderr, r.stderr
    quiet = kvxfer_cmd("bench", "--tokens", "256", "--repeat", "1", KVXFER_PROGRESS_AFTER="1000")
    assert "kvxfer bench:" not in quiet.stderr  # short steps say nothing off a terminal


@pytest.mark.skipif(cuda_devices() > 0, reason="this machine has a CUDA device")
@pytest.mark.parametrize("cmd", ["bench", "demo"])
def test_vram_without_cuda_is_one_line(cmd: str) -> None:
    assert_one_line_error(kvxfer_cmd(cmd, "--memory", "VRAM", "--tokens", "256"),
                          "--memory VRAM needs a CUDA device", "use --memory DRAM")


def test_refused_plan_exits_nonzero_and_still_says_why() -> None:
    args = ["plan", "--local", "llama3-70b", "--local-tp", "0/8", "--remote-tp", "1/8", "--tokens", "1k"]
    r = kvxfer_cmd(*args, "--json")
    assert r.returncode == 1
    (row,) = json.loads(r.stdout)
    assert row["mode"] == "refused" and "heads" in row["why"]
    assert r.stderr.strip() == "kvxfer plan: 1 of 1 pairing(s) refused"
    ok = kvxfer_cmd("plan", "--local", "llama3-70b", "--tp", "1/8", "--tokens", "1k", "--json")  # control
    assert ok.returncode == 0 and {r["mode"] for r in json.loads(ok.stdout)} != {"refused"}


def test_blocked_nixl_is_called_blocked() -> None:
    r = kvxfer_cmd("demo", "--backend", "nixl", KVXFER_BLOCK_PLUGINS="nixl")
    assert_one_line_error(r, "'nixl' is blocked by KVXFER_BLOCK_PLUGINS=nixl")
    r = kvxfer_cmd("demo", "--tokens", "256", "--json", KVXFER_BLOCK_PLUGINS="nixl")
    assert r.returncode == 0, r.stderr
    assert "the nixl plugin is blocked (KVXFER_BLOCK_PLUGINS=nixl)" in r.stderr + r.stdout
    assert "not installed" not in r.stderr + r.stdout
    assert json.loads(r.stdout)["backend"] == "loopback"


def _doctor(*args: str, **env: str) -> tuple[int, list[dict[str, Any]]]:
    r = kvxfer_cmd("doctor", "--json", *args, **env)
    return r.returncode, json.loads(r.stdout)


def _commands(fix: str | None) -> list[list[str]]:
    """The ``kvxfer ...`` commands a fix suggests, placeholders filled in."""
    out = []
    for cmd in re.findall(r"kvxfer [a-z][^,;()`]*", fix or ""):
        argv = cmd.replace("ADDRESS", "127.0.0.1").replace("TOKEN", "secret").split()[1:]
        out.append([a for a in argv if a not in ("checks", "serving", "on", "that", "address")])
    return out


def test_doctor_warns_only_about_what_is_wrong_and_its_advice_parses() -> None:
    """One doctor run (each costs CI about 5 s): the peer check fails, the healthy ones do not."""
    code, checks = _doctor("--peer", "127.0.0.1:9", KVXFER_TOKEN="")
    by = {c["check"]: c for c in checks}
    for healthy in ("progress thread", "load", "hostname"):  # off by default / a fact of the moment / one host
        if healthy in by:
            assert by[healthy]["status"] in ("ok", "info"), by[healthy]
    peer = next(c for c in checks if c["check"] == "peer")
    assert code == 1 and peer["status"] == "fail" and "--token" in peer["fix"]
    suggested = [argv for c in checks for argv in _commands(c.get("fix"))]
    assert suggested, "the peer check suggests a kvxfer command"
    ap = build_parser()
    for argv in suggested:
        ap.parse_args(argv)  # exits (fails the test) if the CLI would not accept the advice


def test_member_lists_sort_naturally() -> None:
    local = kvxfer.spec_from_arrays({f"layer.{i}": np.zeros((4, 64), np.uint8) for i in range(12)})
    remote = kvxfer.spec_from_arrays({f"layer.{i}": np.zeros((4, 64), np.uint8) for i in range(2)})
    with pytest.raises(kvxfer.LayoutMismatchError) as ei:
        kvxfer.check_pairing(local, remote)
    only_local = dict((f, lv) for f, lv, _ in ei.value.diff)["members"]
    assert only_local.startswith("layer.2, layer.3, layer.4"), only_local
