"""The docs run: every Python block of README.md, CONTRIBUTING.md and docs/, and every
``$ kvxfer ...`` example, is executed here, and each example's output has the doc's shape.

A Python block runs on its own in a fresh interpreter of a virtualenv holding kvxfer's wheel
(the session's ``wheel_venv``), from an empty directory outside the checkout, exactly as a
reader would paste it (no hidden set-up), so a block that needs a name it does not define, or
a file only a checkout has, fails. The ``kvxfer`` examples run the wheel's script the same way.
A block that is only a sketch carries ``<!-- sketch: NAME -->`` and is excluded by that
name in :data:`SKETCHES`; marking a new one without naming it here fails too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from doc_blocks import REPO, Block, Example, all_blocks, cli_examples, shape

#: Sketches, by name: why each cannot run here, and what runs the same calls instead.
SKETCHES = {
    "fleet-etcd": "needs an etcd at the address shown; examples/fleet.py makes the same calls "
                  "(tests/test_etcd.py::test_fleet_example_moves_verified_requests)",
    "vllm-tier": "an engine start (vLLM is not in this venv, and its worker side needs a GPU); "
                 "tests/vllm/test_vllm_tier.py::test_selected_by_vllms_factory_from_the_extra_config builds the "
                 "tier from the same extra config through vLLM's own factory",
    "vllm-tier-cluster": "a fragment of the vLLM tier's extra config, pointing at a master elsewhere; "
                         "tests/vllm/test_vllm_tier_cluster.py builds the tier from these keys against a "
                         "real master on loopback",
    "store-api": "a summary of the store's calls over names it does not define; README's \"Offload to "
                 "host memory and NVMe\" block makes the same calls and runs",
}

#: Examples that are not ``kvxfer`` commands, and the test that runs them instead.
RUN_ELSEWHERE = {
    "python examples/fleet.py --prefill 3 --decode 2 --requests 24":
        "tests/test_etcd.py::test_fleet_example_moves_verified_requests (needs etcd)",
}

#: Examples that would take minutes or write into the repository run smaller here; their
#: tables must still have the doc's columns (``headers``), not its row count.
SMALLER = {
    "kvxfer bench --tokens 256,1k,4k,16k --repeat 3 --plot docs/bench-loopback.png":
        ["bench", "--tokens", "256,1k", "--repeat", "1"],
    "kvxfer demo": ["demo", "--tokens", "1k"],
    "kvxfer bench --store /tmp --tokens 1k,4k --repeat 3":
        ["bench", "--store", "/tmp", "--tokens", "1k", "--repeat", "1"],
}
#: Output that depends on the machine: only the tables' columns are compared. docs/cli.md
#: shows only the columns of the measuring commands (their runs are in BENCHMARKS.md).
#: ``kvxfer backends`` lists what is installed: the wheel with ``[nixl,kit]`` has no Mooncake row.
HEADERS_ONLY = {"kvxfer doctor", "kvxfer backends", *SMALLER}
#: Examples the doc shows failing on purpose (a refused plan still prints why), by exit status.
EXIT = {"kvxfer plan --local docs/specs/llama3-70b-tp8.toml --remote-tp 2/8 --tokens 32768": 1}

#: Examples that plan a file of the checkout (docs/cli.md says they do): they run from its root.
CHECKOUT = {"kvxfer plan --local docs/specs/llama3-70b-tp8.toml --remote-tp 1/8 --remote-layout both --tokens 32768",
            "kvxfer plan --local docs/specs/llama3-70b-tp8.toml --remote-tp 2/8 --tokens 32768"}

PYTHON = [b for b in all_blocks("python") if b.sketch is None]


def test_sketches_are_named() -> None:
    marked = {b.sketch for lang in ("python", "text", "bash", "toml") for b in all_blocks(lang) if b.sketch}
    assert marked == set(SKETCHES), "a block marked as a sketch must be named in SKETCHES, and only those"
    assert len(PYTHON) >= 8  # README, CONTRIBUTING and docs/spec-files.md hold runnable blocks


def _reader(venv: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An empty working directory outside the checkout, and an environment where only the wheel
    is kvxfer (no ``PYTHONPATH`` into a checkout), with its own ``TMPDIR`` so what stays is seen."""
    (cwd := tmp_path / "cwd").mkdir(exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TMPDIR=str(tmp_path / "tmp"), PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}")
    return cwd, env


def run_block(block: Block, venv: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run one block with the wheel's interpreter, from an empty directory."""
    script = tmp_path / "block.py"
    script.write_text(block.text)
    cwd, env = _reader(venv, tmp_path)
    return subprocess.run([str(venv / "bin" / "python"), str(script)], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def _left_behind(tmp_path: Path) -> int:
    """Bytes left in the block's ``TMPDIR`` and working directory."""
    return sum(p.stat().st_blocks * 512 for d in ("tmp", "cwd") for p in (tmp_path / d).rglob("*") if p.is_file())


def test_blocks_run_against_the_wheel_not_the_checkout(wheel_venv: Path, tmp_path: Path) -> None:
    block = Block("test", 0, "python", "import kvxfer, kvxfer_nixl\nprint(kvxfer.__file__, kvxfer_nixl.__file__)", None)
    r = run_block(block, wheel_venv, tmp_path)
    assert r.returncode == 0 and r.stdout.count(str(wheel_venv)) == 2 and str(REPO) not in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_python_block_runs(block: Block, wheel_venv: Path, tmp_path: Path) -> None:
    """Each block runs, leaves nothing in its working directory and no more than 1 MiB on disk: a
    user copies it as it is (the README's store example once left a preallocated 1 GiB slab per
    run, and filled CI's disk; the API fuzz once left stores in the checkout)."""
    r = run_block(block, wheel_venv, tmp_path)
    assert r.returncode == 0, f"{block.name} does not run:\n{r.stderr[-3000:]}"
    assert not os.listdir(tmp_path / "cwd"), f"{block.name} writes {os.listdir(tmp_path / 'cwd')} into the cwd"
    assert _left_behind(tmp_path) <= 1 << 20, f"{block.name} leaves {_left_behind(tmp_path):,} bytes behind"


def test_a_block_that_leaves_a_slab_is_caught(wheel_venv: Path, tmp_path: Path) -> None:
    """The control: the README's store example without its last line leaves its slab; with its
    store in the working directory, it leaves a folder there."""
    store = next(b for b in PYTHON if b.file == "README.md" and "kvxfer.Store(" in b.text)
    assert "shutil.rmtree(path)" in store.text and "path = tempfile.mkdtemp()" in store.text
    kept = Block(store.file, store.line, store.lang, store.text.replace("shutil.rmtree(path)", "pass", 1), None)
    assert run_block(kept, wheel_venv, tmp_path).returncode == 0
    assert _left_behind(tmp_path) > 1 << 20
    here = Block(store.file, store.line, store.lang, store.text.replace("path = tempfile.mkdtemp()", "path = 'x'", 1)
                 .replace("shutil.rmtree(path)", "pass", 1), None)
    shutil.rmtree(tmp_path / "cwd")
    assert run_block(here, wheel_venv, tmp_path).returncode == 0
    assert os.listdir(tmp_path / "cwd") == ["x"]


def test_a_broken_block_fails(wheel_venv: Path, tmp_path: Path) -> None:
    """The control: the README's first block with one name misspelled must fail to run."""
    first = next(b for b in PYTHON if b.file == "README.md")
    assert "decode.read(" in first.text
    broken = Block(first.file, first.line, first.lang, first.text.replace("decode.read(", "decoder.read(", 1), None)
    r = run_block(broken, wheel_venv, tmp_path)
    assert r.returncode != 0 and "NameError" in r.stderr


EXAMPLES = [e for e in cli_examples() if e.command not in RUN_ELSEWHERE]


def test_every_example_is_run() -> None:
    commands = {e.command for e in cli_examples()}
    assert set(RUN_ELSEWHERE) | set(SMALLER) | CHECKOUT <= commands, "a renamed example: update this file"
    assert all(e.command.startswith("kvxfer ") for e in EXAMPLES)


def _argv(e: Example) -> list[str]:
    return SMALLER.get(e.command) or e.command.split()[1:]


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.command for e in EXAMPLES])
def test_cli_example_output_has_the_docs_shape(example: Example, wheel_venv: Path, tmp_path: Path) -> None:
    """The wheel's ``kvxfer`` from an empty directory; an example that names a checkout's file
    (:data:`CHECKOUT`) runs from the repository root."""
    cwd, env = _reader(wheel_venv, tmp_path)
    r = subprocess.run([str(wheel_venv / "bin" / "kvxfer"), *_argv(example)], cwd=REPO if example.command in CHECKOUT
                       else cwd, capture_output=True, text=True, timeout=600, env=env)
    documented = [ln for ln in example.output if ln.strip()]
    if documented and documented[0].startswith(f"{example.command.split()[0]} ") and ": error:" in documented[0]:
        assert r.returncode != 0 and r.stderr.strip().splitlines() == documented, r.stderr
        return
    assert r.returncode == EXIT.get(example.command, 0), r.stderr[-3000:]
    want, got = shape(example.output), shape(r.stdout.splitlines())
    if example.command in HEADERS_ONLY:
        want, got = ([s for s in x if s[0] == "header"] for x in (want, got))
    assert got == want, f"{example.command}: the output no longer looks like the doc\n{r.stdout}"


def test_shape_catches_a_changed_table() -> None:
    """The control for the shape check: a column renamed, or a row dropped, is noticed."""
    e = next(e for e in EXAMPLES if e.command == "kvxfer plan --preset mla-61 --preset gqa-80")
    renamed = [ln.replace("descriptors", "descs") for ln in e.output]
    assert shape(renamed) != shape(e.output)
    rows = [i for i, ln in enumerate(e.output) if ln.startswith("mla-61")]
    assert shape(e.output[:rows[0]] + e.output[rows[0] + 1:]) != shape(e.output)
