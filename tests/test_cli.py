"""The ``kvxfer`` command end to end, through its installed entry point, as a user runs it.

Numbers in the JSON outputs are checked against counts computed here from the model's
geometry, not against the planner; bytes moved by ``bench`` are checked by ``bench`` itself,
and a test proves that check fails when a backend moves the wrong blocks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import kvxfer

REPO = Path(__file__).resolve().parent.parent
SPECS = REPO / "docs" / "specs"
MLA_ROW = 61 * 64 * 576 * 2  # bytes per block of the mla-61 preset: layers x tokens x channels x bf16


def _entry() -> list[str]:
    """The installed ``kvxfer`` script next to this interpreter, else ``python -m kvxfer.cli``."""
    script = Path(sys.executable).with_name("kvxfer")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvxfer.cli"]


def kvxfer_cmd(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_entry(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def as_json(r: subprocess.CompletedProcess[str], code: int = 0) -> Any:
    """The JSON a command printed; ``code`` 1 for a plan that refuses (it still prints why)."""
    assert r.returncode == code, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(r.stdout)


def assert_one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("kvxfer"), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


def test_version_through_both_entry_points() -> None:
    r = kvxfer_cmd("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvxfer {kvxfer.__version__}"
    r = subprocess.run([sys.executable, "-m", "kvxfer.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == f"kvxfer {kvxfer.__version__}"


def test_backends_table_and_json() -> None:
    rows = as_json(kvxfer_cmd("backends", "--json"))
    loop = next(r for r in rows if r["backend"] == "loopback")
    assert loop["status"] == "available" and loop["plugin"] == "loopback"
    assert "DRAM" in loop["capabilities"]["memory"] and loop["capabilities"]["cross_process"] is False
    r = kvxfer_cmd("backends")
    assert r.returncode == 0
    header, *body = [ln for ln in r.stdout.splitlines() if ln.strip() and not set(ln.strip()) <= {"─"}]
    assert header.split()[:4] == ["backend", "plugin", "version", "status"]
    assert any(ln.split()[0] == "loopback" and "available" in ln for ln in body)


def test_blocked_backend_shows_unavailable_reason_and_install_hint() -> None:
    rows = as_json(kvxfer_cmd("backends", "--json", KVXFER_LIBUCP="/nonexistent/libucp.so"))
    ucx = next((r for r in rows if r["backend"] == "ucx"), None)
    if ucx is None:
        pytest.skip("the ucx plugin is not installed")
    if ucx["status"] == "available":
        pytest.skip("a libucp is found without KVXFER_LIBUCP on this machine")
    from kvxfer.extras import install_hint

    assert ucx["status"] == "unavailable" and ucx["install"] == install_hint("ucx")
    assert ucx["install"].startswith("pip install 'libucx-cu12")


def _unvalidated(spec: str) -> list[str]:
    """Releases of libucx-cu12 that ``spec`` admits but the stuck-slot skip was not validated on."""
    from packaging.specifiers import SpecifierSet

    from kvxfer.ucxabi.mmqueue import LAYOUT_VERSIONS

    candidates = [f"1.{minor}.{patch}" for minor in range(14, 40) for patch in range(3)]
    return [v for v in SpecifierSet(spec).filter(candidates)
            if tuple(int(x) for x in v.split(".")[:2]) not in LAYOUT_VERSIONS]


def test_the_ucx_extra_admits_only_validated_releases() -> None:
    """Issue 30, item 14: ``pip install 'kvxfer[ucx]'`` resolved 1.22, where the stuck-slot
    skip is off. The extra now admits only releases whose queue layout it knows. Control:
    the old requirement (>=1.18) admits 1.22 and others."""
    import tomllib

    pytest.importorskip("kvxfer_ucx")
    doc = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    (req,) = doc["project"]["optional-dependencies"]["ucx"]
    assert req.startswith("libucx-cu12")
    assert _unvalidated(req.removeprefix("libucx-cu12")) == []
    assert "1.22.0" in _unvalidated(">=1.18")  # control


def test_plan_presets_json_counts() -> None:
    rows = as_json(kvxfer_cmd("plan", "--preset", "mla-61", "--tokens", "6400", "--json"))
    assert [(r["local"], r["remote"], r["mode"]) for r in rows] == [
        ("mla-61 packed", "mla-61 packed", "whole-row"), ("mla-61 packed", "mla-61 layers", "split")]
    blocks = 6400 // 64
    assert [r["descriptors"] for r in rows] == [blocks, blocks * 61]
    assert all(r["bytes"] == blocks * MLA_ROW and r["blocks"] == blocks for r in rows)
    assert "per layer" in rows[1]["why"]


def test_plan_default_table_lists_every_preset() -> None:
    from kvxfer.geometry import PRESETS

    r = kvxfer_cmd("plan", "--tokens", "1000")
    assert r.returncode == 0, r.stderr
    for name in PRESETS:
        assert f"{name} packed" in r.stdout
    assert "descriptors" in r.stdout and "why" in r.stdout


@pytest.mark.parametrize("spec,members_per_block", [
    ("glm5-mla.toml", 78 * 2),          # kv + indexer per layer, replicated
    ("llama3-70b-tp8.toml", 80 * 2),    # k + v per layer
    ("qwen-hybrid.json", 24 * 2),       # pipeline stage 0 of 2: layers 0-23, two members each
])
def test_plan_spec_files(spec: str, members_per_block: int) -> None:
    rows = as_json(kvxfer_cmd("plan", "--local", str(SPECS / spec), "--local-layout", "packed",
                              "--remote-layout", "both", "--tokens", "4096", "--json"))
    whole, split = rows
    assert whole["mode"] == "whole-row" and split["mode"] == "split"
    blocks = whole["blocks"]
    assert whole["descriptors"] == blocks and split["descriptors"] == blocks * members_per_block
    assert whole["bytes"] == split["bytes"]


def test_plan_tp_options() -> None:
    # GQA pages are head-split: rank 0 and rank 1 of TP8 hold different heads -> refused.
    rows = as_json(kvxfer_cmd("plan", "--local", "llama3-70b", "--local-tp", "0/8", "--remote-tp", "1/8",
                              "--tokens", "160", "--json"), code=1)
    assert rows[0]["mode"] == "refused" and rows[0]["descriptors"] is None
    assert "different KV heads" in rows[0]["why"] and "heads [0, 1) of 8 (TP rank 0 of 8) vs heads [1, 2) of 8" in \
        rows[0]["why"]
    assert rows[0]["error"] == "HeadSliceMismatchError"
    # The same rank moves whole rows.
    rows = as_json(kvxfer_cmd("plan", "--local", "llama3-70b", "--local-tp", "1/8", "--remote-tp", "1/8",
                              "--tokens", "160", "--json"))
    assert rows[0]["mode"] == "whole-row" and rows[0]["descriptors"] == 10
    assert rows[0]["bytes"] == 10 * 80 * 2 * 16 * 128 * 2  # blocks x layers x K,V x tokens x head_dim x bf16
    # MLA is replicated: any two ranks move whole rows.
    rows = as_json(kvxfer_cmd("plan", "--local", "glm5-mla", "--local-tp", "0/8", "--remote-tp", "5/8",
                              "--tokens", "640", "--json"))
    assert rows[0]["mode"] == "whole-row" and rows[0]["descriptors"] == 10



@pytest.mark.parametrize("sides, peers", [
    (("--local-tp", "0/8", "--remote-tp", "0/4"), {"tp0/4": 1}),         # one remote rank holds this rank's head
    (("--local-tp", "0/4", "--remote-tp", "0/8"), {"tp0/8": 1, "tp1/8": 1}),  # two remote ranks do
    (("--local-tp", "0/1", "--remote-tp", "0/2"), {"tp0/2": 4, "tp1/2": 4}),  # TP2 -> TP1: 4 heads each
    (("--local-pp", "0/1", "--remote-pp", "0/2"), {"pp0/2": 8, "pp1/2": 8}),  # PP2 -> PP1: 40 layers each
])
def test_plan_shows_the_gather_read_many_runs(sides: tuple[str, ...], peers: dict[str, int]) -> None:
    """Issue 33: other TP/PP sizes were refused although read_many runs them. The plan reads only the
    ranks holding this rank's pages, each for the heads (x layers) it holds: bytes from the model's
    arithmetic. The control is test_plan_tp_options: same-size sides on different ranks stay refused."""
    rows = as_json(kvxfer_cmd("plan", "--local", "llama3-70b", *sides, "--tokens", "160", "--json"))
    (row,) = rows
    assert row["mode"] == "gather", row
    assert {n.split()[-1]: d for n, d in row["peers"].items()} == {
        rank: 10 * 80 * 2 // 2 ** ("pp" in rank) for rank in peers}  # blocks x layers x K,V per peer
    head_bytes = 10 * 16 * 128 * 2  # blocks x tokens x head_dim x bf16, one layer's K or V of one head
    layers = 80 // 2 ** ("pp" in next(iter(peers)))
    assert row["bytes"] == sum(h * layers * 2 * head_bytes for h in peers.values())


def test_plan_list() -> None:
    rows = as_json(kvxfer_cmd("plan", "--list", "--json"))
    by = {r["preset"]: r for r in rows}
    assert by["mla-61"]["row_bytes"] == MLA_ROW
    assert by["llama3-70b"]["row_bytes"] == 80 * 2 * 16 * 8 * 128 * 2
    assert by["qwen-hybrid"]["row_bytes"] == 12 * 2 * 64 * 2 * 256 * 2 + 36 * (32 * 256 * 3 * 2 + 32 * 128 * 128 * 2)
    assert by["glm5-mla"]["row_bytes"] == 78 * 64 * (576 * 2 + 132)


@pytest.fixture(scope="module")
def bad_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    p = tmp_path_factory.mktemp("specs") / "bad.toml"
    p.write_text('layers = 2\nblock_tokens = 16\n[[groups]]\nlayers = "all"\n'
                 '[[groups.members]]\ndtype = "bf61"\nhead_dim = 8\n')
    return str(p)


@pytest.mark.parametrize("args,needles", [
    (["plan", "--preset", "foo"], ["no preset named 'foo'"]),
    (["plan", "--tokens", "0"], ["--tokens", "positive"]),
    (["plan", "--local", "/nonexistent/model.toml"], ["cannot read"]),
    (["plan", "--local", "BAD_SPEC"], ["groups[0].members[0].dtype", "bf61"]),
    (["plan", "--local-tp", "3/2"], ["RANK/SIZE"]),
    (["plan", "--local", "mla-61", "--preset", "glm-99"], ["--preset"]),
    (["plan", "--no-such-option"], ["unrecognized arguments"]),
    (["no-such-command"], ["invalid choice"]),
    (["bench", "--layouts", "packed:rows"], ["--layouts"]),
    (["bench", "--processes", "2", "--backend", "loopback"], ["cannot cross processes"]),
    (["bench", "--backend", "no-such-backend"], ["no backend named"]),
    (["bench", "--tokens", "12,x"], ["--tokens"]),
    (["bench", "--options", "{not json"], ["--options"]),
    (["bench", "--plot", "/nonexistent/folder/x.png"], ["--plot"]),
    (["bench", "--store", "/nonexistent/folder"], ["--store"]),
    (["demo", "--tokens", "-5"], ["--tokens"]),
    (["demo", "--backend", "no-such-backend"], ["no backend named"]),
    (["doctor", "--listen", "nonsense"], ["--listen"]),
    (["demo", "--tokens", "100000000000"], ["GB of host memory"]),
    (["bench", "--tokens", "100000000000"], ["GB of host memory"]),
])
def test_bad_input_is_one_line_and_nonzero(args: list[str], needles: list[str], bad_spec: str) -> None:
    r = kvxfer_cmd(*[bad_spec if a == "BAD_SPEC" else a for a in args], timeout=300)
    assert_one_line_error(r, *needles)


def test_bench_loopback_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    rows = as_json(kvxfer_cmd("bench", "--tokens", "64,192", "--repeat", "1", "--json", "--plot", str(png),
                              "--layouts", "packed:packed,layers:packed,packed:layers"))
    got = {(r["layout"], r["tokens"]): r for r in rows}
    assert set(got) == {(lo, t) for lo in ("packed:packed", "layers:packed", "packed:layers") for t in (64, 192)}
    for (layout, tokens), r in got.items():
        blocks = tokens // 64
        assert r["blocks"] == blocks and r["bytes"] == blocks * MLA_ROW
        assert r["descriptors"] == (blocks if layout == "packed:packed" else blocks * 61)
        assert r["verified"] == 2 and r["gbps"] > 0  # warm-up + 1 timed run, each checked byte for byte
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w = matplotlib.image.imread(str(png)).shape[:2]
    assert w > 600 and h > 300


def test_bench_table_output() -> None:
    r = kvxfer_cmd("bench", "--tokens", "64", "--repeat", "1", "--op", "write")
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stdout and "verified runs" in r.stdout and "write" in r.stdout


def test_bench_store_json_and_table(tmp_path: Path) -> None:
    """``bench --store``: offload and restore rows per layout and size, each run verified by
    the bench (sentinel elsewhere); the temporary store is removed afterwards."""
    rows = as_json(kvxfer_cmd("bench", "--store", str(tmp_path), "--tokens", "128", "--repeat", "1", "--json",
                              "--layouts", "packed:packed,layers:packed"))
    got = {(r["op"], r["layout"]): r for r in rows}
    assert set(got) == {(op, lo) for op in ("offload", "restore") for lo in ("packed", "layers")}
    for (op, layout), r in got.items():
        assert r["blocks"] == 2 and r["bytes"] == 2 * MLA_ROW and r["verified"] == 2 and r["gbps"] > 0
        assert r["path"] == ("pwritev" if op == "offload" else "preadv")
        # A row per block, or a page per member and block (random blocks may merge into runs).
        assert (1 <= r["descriptors"] <= 2) if layout == "packed" else (61 <= r["descriptors"] <= 2 * 61)
    assert list(tmp_path.iterdir()) == []
    r = kvxfer_cmd("bench", "--store", str(tmp_path), "--tokens", "64", "--repeat", "1")
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stdout and "pwritev" in r.stdout and "verified runs" in r.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend,op", [("nixl", "write"), ("ucx", "read")])
def test_bench_two_processes(backend: str, op: str) -> None:
    status = {s.name: s for s in kvxfer.available_backends()}
    if backend not in status or not status[backend].available:
        pytest.skip(f"{backend} is not available here")
    rows = as_json(kvxfer_cmd("bench", "--backend", backend, "--processes", "2", "--op", op, "--tokens", "128",
                              "--repeat", "1", "--json", "--layouts", "packed:packed,layers:packed"))
    assert [r["descriptors"] for r in rows] == [2, 2 * 61]
    assert all(r["verified"] == 2 and r["processes"] == 2 for r in rows)


def test_a_peer_process_that_fails_is_one_line() -> None:
    status = {s.name: s for s in kvxfer.available_backends()}
    if "ucx" not in status or not status["ucx"].available:
        pytest.skip("ucx is not available here")
    r = kvxfer_cmd("bench", "--backend", "ucx", "--processes", "2", "--tokens", "64", "--repeat", "1",
                   "--options", '{"no_such_option": 1}')
    assert_one_line_error(r, "PeerError", "no_such_option")


_SWAPPED = """
import sys
import numpy as np
import kvxfer
from kvxfer_loopback.backend import LoopbackBackend
from kvxfer.plugin.registry import plugin_manager


class Swapped(LoopbackBackend):
    # Moves the right amount of bytes from the wrong remote blocks.
    name = "swapped"

    def post(self, op, local, local_idx, remote, remote_idx, notification):
        return super().post(op, local, local_idx, remote, np.roll(remote_idx, 1), notification)


class Plugin:
    @kvxfer.hookimpl
    def kvxfer_register_backends(self, register):
        register("swapped", Swapped)


plugin_manager().register(Plugin(), name="swapped")
from kvxfer.cli import main
sys.exit(main(["bench", "--backend", "swapped", "--tokens", "128", "--repeat", "1", "--layouts", "LAYOUT"]))
"""


@pytest.mark.parametrize("layout", ["packed:packed", "layers:packed"])
def test_bench_catches_wrong_bytes(layout: str) -> None:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_SWAPPED).replace("LAYOUT", layout)],
                       capture_output=True, text=True, timeout=300)
    assert_one_line_error(r, "VerificationError", "VERIFY FAILED")


def test_demo_help_shows_real_options() -> None:
    r = kvxfer_cmd("demo", "--help")
    assert r.returncode == 0
    for opt in ("--backend", "--tokens", "--preset", "--memory", "--seed", "--token", "--json"):
        assert opt in r.stdout
    assert "rest" not in r.stdout.split("options:")[0].split("usage:")[1]


def test_demo_json_on_loopback() -> None:
    report = as_json(kvxfer_cmd("demo", "--backend", "loopback", "--tokens", "256", "--json"))
    assert report["backend"] == "loopback" and report["blocks"] == 4
    whole, layers = report["results"]
    assert (whole["descriptors"], layers["descriptors"]) == (4, 4 * 61)
    assert whole["bytes"] == layers["bytes"] == 4 * MLA_ROW
    phases = [t["phase"] for t in report["timings"]]
    for p in ("start-up", "registration", "handshake", "transfers", "verification"):
        assert p in phases
    assert abs(sum(t["seconds"] for t in report["timings"]) - report["total_seconds"]) < 1e-6


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_doctor_json_and_a_failing_peer() -> None:
    r = kvxfer_cmd("doctor", "--json", "--peer", f"127.0.0.1:{_closed_port()}", "--token", "s3cret")
    assert r.returncode == 1, r.stderr  # the unreachable peer is a failure
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    for name in ("nixl", "ucx", "cuda", "cuda_ipc", "cpus", "progress thread", "side channel", "peer"):
        assert name in checks, sorted(checks)
    assert checks["side channel"]["status"] == "ok"
    if "metadata prover" in checks:  # NIXL is installed: its helper starts on this machine
        assert checks["metadata prover"]["status"] == "ok", checks["metadata prover"]
    assert checks["peer"]["status"] == "fail" and "MetadataServer" in checks["peer"]["fix"]
    for c in checks.values():
        assert c["status"] in ("ok", "warn", "fail", "info")
        if c["status"] in ("warn", "fail"):
            assert c["fix"], c


def test_doctor_names_a_prover_that_does_not_start() -> None:
    """The check above reads ok; here the helper's target is missing, and doctor says so with a fix."""
    from kvxfer.plugin.doctor import check_prover

    (c,) = check_prover("kvxfer.testing.no_such_module:factory", {})
    assert c.status == "fail" and "no_such_module" in c.detail and "KVXFER_PROVE_LOG" in (c.fix or "")
    (ok,) = check_prover("kvxfer._harness.probes:make_probe", {"log": os.devnull})
    assert ok.status == "ok", ok


def test_doctor_shows_the_loaded_ucx_and_whether_the_stuck_slot_skip_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30, item 14: the UCX version loaded and the stuck-slot skip, through the plugin's
    public ``diagnostics()`` (doctor imports no private module of it). Control: a release
    outside the validated ones (the table emptied) reads as off, with a warning and a fix."""
    import ast

    ucx = pytest.importorskip("kvxfer_ucx")
    from kvxfer.cli import doctor
    from kvxfer.ucxabi import mmqueue as _stuckslot
    from kvxfer_ucx import _doctor

    d = ucx.diagnostics()
    if d["version"] is None:
        pytest.skip(f"libucp does not load here: {d['error']}")
    checks = {c.check: c for c in _doctor.check_ucx(0, d)}
    skip = checks["ucx stuck-slot"]
    assert d["version"] in checks["ucx"].detail
    assert d["stuck_slot_skip"] == (tuple(int(x) for x in d["version"].split(".")[:2]) in _stuckslot.LAYOUT_VERSIONS)
    assert skip.status == ("ok" if d["stuck_slot_skip"] else "warn") and d["version"] in skip.detail
    tree = ast.parse(Path(doctor.__file__).read_text())
    private = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
               and n.module.startswith("kvxfer_ucx._")]
    assert private == []
    text = Path(doctor.__file__).read_text()  # issue 32: doctor names no plugin; each answers kvxfer_doctor_checks
    assert not any(p in text for p in ("kvxfer_ucx", "kvxfer_nixl", "kvxfer_loopback")), "doctor names a plugin"

    monkeypatch.setattr(_stuckslot, "LAYOUT_VERSIONS", frozenset())  # control
    off = {c.check: c for c in _doctor.check_ucx(0, ucx.diagnostics())}["ucx stuck-slot"]
    assert off.status == "warn" and off.detail.startswith("off") and off.fix


def test_doctor_table() -> None:
    r = kvxfer_cmd("doctor")
    assert r.returncode in (0, 1), r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.splitlines()[0].split()[:4] == ["check", "status", "detail", "fix"]
    assert "side channel" in r.stdout


def test_json_stdout_stays_clean_when_a_library_prints(tmp_path: Path) -> None:
    """Anything written to file descriptor 1 during a --json command lands on stderr."""
    code = textwrap.dedent("""
        import os, sys
        import kvxfer.cli.backends as b
        real = b.backend_rows
        def noisy():
            os.write(1, b"banner from a C library\\n")
            print("and from Python")
            return real()
        b.backend_rows = noisy
        from kvxfer.cli import main
        sys.exit(main(["backends", "--json"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)
    assert "banner from a C library" in r.stderr and "and from Python" in r.stderr



def test_doctor_puts_the_token_first_when_the_peer_answered() -> None:
    """A peer that proved it is there but holds another token is not a network problem; the
    control, a closed port, still gets the network advice."""
    from kvxfer.cli.doctor import check_sidechannel
    from kvxfer.sidechannel import MetadataServer

    with MetadataServer(b"md", "127.0.0.1", 0, token="a" * 32) as server:
        checks = {c.check: c for c in check_sidechannel(("127.0.0.1", 0), server.address, "b" * 32)}
    fix = checks["peer"].fix or ""
    assert checks["peer"].status == "fail" and fix.startswith("the peer answered but holds another token")
    assert "firewall" not in fix
    closed = {c.check: c for c in check_sidechannel(("127.0.0.1", 0), ("127.0.0.1", _closed_port()), "b" * 32)}
    assert "firewall" in (closed["peer"].fix or "")
