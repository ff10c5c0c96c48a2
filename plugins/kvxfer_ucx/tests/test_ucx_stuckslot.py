"""A writer that claimed a slot of this agent's receive queue and died must not wedge the agent.

The kill matrix hits the claim-to-mark window only by chance (RELIABILITY.md, reversed);
here a child process claims a slot of the target's own queue exactly as a UCX writer does
(it maps the queue and advances its head) and never marks it. While the child
is stopped, a live peer's READ of the target queues up behind the slot and the slot is kept
(a stopped thread might still be writing it); once the child is killed, the slot is skipped
and the same READ completes with every byte checked. The control is the kill matrix's
``--control-wedge`` (RELIABILITY.md): with the skipping off, the READ never finishes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvxfer.deadlines import Deadline
import kvxfer
from kvxfer.ucxabi import mmqueue as _stuckslot
from kvxfer.testing.lines import Channel

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

sys.path.insert(0, str(Path(__file__).parent))
from ucx_kill_matrix import cache, pattern  # noqa: E402
from ucx_kill_reverse import Initiator  # noqa: E402

ROWS = 16
#: Maps the queue and claims the slot at its head (``uct_mm_ep_get_remote_elem``'s step), then waits.
CLAIM = """
import mmap, os, struct, sys
pid, inode, size = map(int, sys.argv[1:])
def ino(fd):
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_ino
    except OSError:
        return None
(fd,) = [fd for fd in os.listdir(f"/proc/{pid}/fd") if ino(fd) == inode]
f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
seg = mmap.mmap(f, min(size, os.fstat(f).st_size))  # as UCX's posix transport attaches
head = struct.unpack_from("<Q", seg, 0)[0]
struct.pack_into("<Q", seg, 0, head + 1)
print(head & ~(1 << 63), flush=True)
sys.stdin.read()
"""


def _progress_for(agent: kvxfer.Agent, seconds: float) -> None:
    end = Deadline.within(seconds)
    while time.monotonic() < end:
        agent.progress()
        time.sleep(0.001)


def test_a_dead_writers_slot_is_skipped_and_a_stopped_ones_kept() -> None:
    target = kvxfer.Agent("target", backend="ucx", timeout=30, same_host_copy=False)
    if not target.backend._slots.active:  # type: ignore[attr-defined]
        target.close()
        pytest.skip(f"the slot watch knows the queue layout of UCX {sorted(_stuckslot.LAYOUT_VERSIONS)} only")
    mine = pattern(ROWS, 5).copy()
    target.register(cache(mine), replicated=True)
    live = Initiator("rma", ROWS, 1, "live", target.metadata())
    claimer: subprocess.Popen[str] | None = None
    try:
        live.hello(target)
        live.send("READ", 5, 0)
        assert live.reply(target, 60) == {"outcome": "DONE", "ok": True}
        watch = target.backend._slots  # type: ignore[attr-defined]
        assert target.backend._w.fifo is not None  # type: ignore[attr-defined]
        queue = _stuckslot.Queue(*target.backend._w.fifo)  # type: ignore[attr-defined]  # the one peers write into
        claimer = subprocess.Popen([sys.executable, "-c", CLAIM, str(os.getpid()), queue.inode, str(_stuckslot._SEG)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        slot = int(Channel(claimer).line(60))
        claimer.send_signal(signal.SIGSTOP)
        live.send("READ", 5, 7)  # queues up behind the claimed slot
        _progress_for(target, 4 * _stuckslot.SETTLE + 2 * _stuckslot.PERIOD)
        assert watch.skipped == 0 and queue.first_unready() == slot, "a stopped writer's slot was taken from it"
        claimer.kill()
        claimer.wait()
        r = live.reply(target, 60)  # a deadline against a hang only
        assert r == {"outcome": "DONE", "ok": True}, r
        assert watch.skipped == 1
        assert ctypes.c_uint8.from_address(queue.addr + 192 + (slot % _stuckslot.FIFO_SIZE) * 128 + 1).value == 31
    finally:
        if claimer is not None and claimer.poll() is None:
            claimer.kill()
            claimer.wait()
        live.stop()
        target.close()


def test_the_watch_runs_only_on_the_layout_it_knows() -> None:
    """Writing a slot with another release's layout would corrupt the queue, so it stays off there."""
    known = sorted(_stuckslot.LAYOUT_VERSIONS)[0]
    assert _stuckslot.SlotWatch(_stuckslot.CONFIG, (*known, 0)).active  # the control: on where it knows the layout
    assert not _stuckslot.SlotWatch(_stuckslot.CONFIG, (known[0], known[1] + 1, 0)).active
    assert not _stuckslot.SlotWatch({**_stuckslot.CONFIG, "POSIX_FIFO_SIZE": "64"}, (*known, 0)).active
