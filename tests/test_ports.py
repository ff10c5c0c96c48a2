"""kvxfer.testing.ports: a range that is only partly claimable gives back what it claimed,
and the claims directory trusts nothing another user could have put there.

Another live process holds the middle port of the first range tried; ``free_port`` must move
on to the next range *and* release the port it had claimed before meeting the held one,
so that once the holder is gone the whole first range can be had again. The control skips
the release (the old behaviour) and shows the stranded claim then keeps that range away.

Hygiene (issue 30, item 12): the directory is per uid, made 0700 and checked; a claim is
read without following links, without waiting on a FIFO, and bounded. Each test has its
control: the old shared directory, the old reader.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from kvxfer.errors import KvxferError
from kvxfer.testing import ports

FIRST, SECOND = 21000, 22000


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Claims under ``tmp_path``, every port bindable, and ranges tried in the order pushed
    onto the returned list (so the test decides which range comes first)."""
    monkeypatch.setattr(ports, "_RESERVED", tmp_path / "claims")
    monkeypatch.setattr(ports, "_mine", set())
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32768)
    monkeypatch.setattr(ports, "_bindable", lambda port, host: True)
    order: list[int] = []
    monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: order.pop(0))
    yield order


def _hold(port: int, pid: int) -> Path:
    path = ports._RESERVED / str(port)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(str(pid))
    return path


def _owner(port: int) -> int | None:
    path = ports._RESERVED / str(port)
    return int(path.read_text()) if path.exists() else None


def _partly_held_then_freed(order: list[int]) -> int:
    """Try FIRST..FIRST+2 with FIRST+1 held by a live process, then again once it is gone."""
    held = _hold(FIRST + 1, os.getppid())  # the parent is alive for the whole test
    order += [FIRST, SECOND]
    assert ports.free_port(3) == SECOND
    assert _owner(FIRST + 1) == os.getppid()  # another's claim is never touched
    held.unlink()  # the holder has gone
    order += [FIRST, SECOND + 10]
    return ports.free_port(3)


def test_a_partly_claimed_range_is_given_back(sandbox: list[int]) -> None:
    got = _partly_held_then_freed(sandbox)
    assert got == FIRST
    assert [_owner(q) for q in range(FIRST, FIRST + 3)] == [os.getpid()] * 3
    assert [_owner(q) for q in range(SECOND, SECOND + 3)] == [os.getpid()] * 3


def test_control_without_the_release_the_claim_is_stranded(sandbox: list[int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_release", lambda port: None)
    got = _partly_held_then_freed(sandbox)
    assert got == SECOND + 10  # FIRST is still claimed by this process, yet never handed out
    assert _owner(FIRST) == os.getpid() and FIRST not in ports._mine


# ---------------------------------------------------------------------------------------------
# Hygiene: another uid, a FIFO, a symlink


def _old_claimant(path: Path) -> int | None:
    """The reader before the fix: follows links, blocks on a FIFO, reads the whole file."""
    try:
        return int(path.read_text() or "0")
    except (OSError, ValueError):
        return 0


def test_a_fifo_claim_does_not_block(sandbox: list[int]) -> None:
    """A FIFO where a claim would be: replaced, the port handed out. Control: the old reader
    opens it and waits for a writer that never comes (released here by opening one)."""
    fifo = ports._RESERVED / str(FIRST)
    fifo.parent.mkdir(mode=0o700)
    os.mkfifo(fifo)
    sandbox.append(FIRST)
    assert ports.free_port() == FIRST and _owner(FIRST) == os.getpid()

    os.unlink(fifo)  # control
    os.mkfifo(fifo)
    reader = threading.Thread(target=_old_claimant, args=(fifo,), daemon=True)
    reader.start()
    reader.join(1.0)
    blocked = reader.is_alive()
    with open(fifo, "w"):  # let it go
        pass
    reader.join()
    assert blocked, "the old reader did not block on the FIFO"


def test_a_symlink_claim_is_not_followed(sandbox: list[int], tmp_path: Path) -> None:
    """A symlink to /dev/zero (endless) where a claim would be: not followed, replaced, the
    port handed out, and the target untouched. Control: the old reader follows a link (here
    to a file naming a live process, since following /dev/zero would exhaust memory) and
    believes the port taken."""
    claims = ports._RESERVED
    claims.mkdir(mode=0o700)
    (claims / str(FIRST)).symlink_to("/dev/zero")
    sandbox.append(FIRST)
    assert ports.free_port() == FIRST and _owner(FIRST) == os.getpid()
    assert not (claims / str(FIRST)).is_symlink()

    target = tmp_path / "elsewhere"
    target.write_text(str(os.getppid()))
    (claims / str(SECOND)).symlink_to(target)
    assert ports._claimant(claims / str(SECOND)) is None  # the fixed reader: no claim
    assert _old_claimant(claims / str(SECOND)) == os.getppid()  # control: the link was followed
    assert target.read_text() == str(os.getppid())


def test_a_claims_directory_of_another_uid_is_refused(sandbox: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory exists, made by another uid (world-writable, as a shared /tmp name
    would be): refused with a typed error naming it, before any claim is read or made.
    Also refused: our own directory when others may write it. Control: the check taken out,
    the claim lands in the other user's directory."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory owned by another uid")
    claims = ports._RESERVED
    claims.mkdir()
    os.chown(claims, 65534, 65534)
    os.chmod(claims, 0o777)
    sandbox += [FIRST, FIRST, FIRST]
    with pytest.raises(KvxferError, match="not a private directory of uid"):
        ports.free_port()
    assert not list(claims.iterdir())
    os.chown(claims, os.getuid(), os.getgid())
    with pytest.raises(KvxferError, match="not a private directory"):
        ports.free_port()  # ours, but mode 0777

    os.chown(claims, 65534, 65534)  # control
    monkeypatch.setattr(ports, "_directory", lambda: claims)
    assert ports.free_port() == FIRST
    assert (claims / str(FIRST)).exists()  # a claim in a directory another user controls


_AS_OTHER = r"""
import os, sys, tempfile
from kvxfer.testing import ports
os.setgroups([]); os.setgid(65534); os.setuid(65534)
if sys.argv[1] == "shared":
    ports._RESERVED = ports._where().parent / "kvxfer-ports"  # the old shared directory, unchecked
    ports._directory = lambda: ports._RESERVED
try:
    print(ports.free_port(), ports._where())
except PermissionError as exc:
    print("PermissionError", exc)
"""


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary directory every user may reach, sticky like /tmp."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvxfer-ports-test-", dir="/tmp"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_another_uid_gets_its_own_directory(shared_tmp: Path) -> None:
    """Root has claimed a port; a process of another uid then claims one in its own
    directory (0700, its own). Control: the old shared directory, made by the first user,
    gives the second a PermissionError."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")
    shared = shared_tmp
    env = {**os.environ, "TMPDIR": str(shared)}
    first = subprocess.run([sys.executable, "-c", "from kvxfer.testing import ports; print(ports.free_port())"],
                           env=env, capture_output=True, text=True, check=True)
    assert int(first.stdout)
    (shared / "kvxfer-ports").mkdir(mode=0o755)  # as the first user's umask made the old shared one
    for mode in ("own", "shared"):
        out = subprocess.run([sys.executable, "-c", _AS_OTHER, mode], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        if mode == "own":
            st = os.lstat(out[1])
            assert int(out[0]) and out[1] == str(shared / "kvxfer-ports-65534")
            assert st.st_uid == 65534 and st.st_mode & 0o777 == 0o700
        else:
            assert out[0] == "PermissionError", out
