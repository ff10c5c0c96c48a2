"""A receive-queue slot left half-written by a process that died is skipped, once proven dead.

Over the ``posix`` transport every process that reaches a worker writes into that worker's
one receive queue (``uct_mm_ep_am_common_send``): it claims the next slot by
advancing the queue's head, fills it, and only then marks it ready; the owner reads slots in
order only (``uct_mm_iface_poll_fifo``). A writer killed between claim and mark leaves a slot
that never becomes ready, and every message queued behind it, from every peer, waits for
good. An agent's own worker is the one every peer that reads or writes it writes into (its
GET requests, a PUT's data), so one killed initiator stopped the agent serving everyone else
(RELIABILITY.md, "Peer killed mid-transfer", reversed). The slot is in this process's own
memory: skipping it is a matter of marking it ready as an empty message of an active-message
id nobody handles (UCX warns and drops it).

Marking a slot a *live* writer is still filling would lose or corrupt its message, so a slot
is skipped only when no live thread can be inside that write. The writer's claim-to-mark
path is straight-line code (a copy of at most one segment) that never sleeps; so a slot that
stays unready while every thread that maps the queue has either run (its CPU time, from
``/proc/PID/task/TID/schedstat``, grew by at least :data:`RAN_NS`) or slept (or is a zombie) in both samples
can only belong to a thread that no longer exists (the slot is read again after the second
sample: a thread that ran would have marked it by then). A thread stopped, in uninterruptible
sleep, or runnable without getting the CPU keeps the slot as it is until a later round.
Another user's processes cannot open the queue (mode 0600); one of this user's whose
memory map cannot be read (not dumpable) counts as mapping it, and one whose threads cannot
be read blocks the skip.
Nothing here runs unless the first unready slot stayed the same for :data:`SETTLE` seconds,
and it looks at most every :data:`PERIOD` seconds.

The queue's layout (its control block and 128-byte slots, 256 of them) is that of the
releases in :data:`kvxfer.ucxabi.VALIDATED`, pinned by the transport configuration
(:data:`CONFIG`); another UCX release (:data:`LAYOUT_VERSIONS`) turns the watch off, since a
slot written with the wrong layout would corrupt the queue it means to unblock. A queue whose control block does not name this process, or whose size is
not the expected one, is left alone.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import threading
import time
from typing import Iterable, Mapping

import numpy as np

from . import VALIDATED

__all__ = ["CONFIG", "CREATING", "ENABLED", "LAYOUT_VERSIONS", "Queue", "SlotWatch", "new_queue", "queues"]

#: UCX releases (major, minor) whose receive-queue layout this module was checked against.
LAYOUT_VERSIONS = VALIDATED["receive queue"]
FIFO_SIZE, ELEM_SIZE = 256, 128
#: UCX settings that fix the layout read here (``_config`` adds them to every agent's).
CONFIG = {"POSIX_FIFO_SIZE": str(FIFO_SIZE), "POSIX_FIFO_ELEM_SIZE": str(ELEM_SIZE)}
_CTL = 192  # sizeof(uct_mm_fifo_ctl_t), cache-line aligned: head at 0, tail at 128, pid at 136
_SEG = -(-(_CTL + FIFO_SIZE * ELEM_SIZE + 63) // mmap.PAGESIZE) * mmap.PAGESIZE
_ARMED = 1 << 63  # the head's event-armed bit
_OWNER, _INLINE = 1, 2  # slot flags
_SKIP_AM_ID = 31  # below UCT_AM_ID_MAX (32), above every id UCP handles (28 in the releases checked)
PERIOD, SETTLE, RAN_NS = 0.25, 0.5, 1_000_000
#: Off only for the control run that shows the wedge (``ucx_kill_matrix.py --reverse --control-wedge``).
ENABLED = [True]
_MAPS = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ 0+ (\S+) (\d+) +/dev/shm/ucx_shm_posix_", re.M)
_log = logging.getLogger("kvxfer")


def _threads(dev: str, inode: str, me: int) -> dict[int, tuple[str, int]] | None:
    """``{tid: (state, ns on CPU)}`` of every thread of every process that maps the segment,
    this thread excepted; None when one of them could not be read."""
    out: dict[int, tuple[str, int]] = {}
    needle = f" {dev} {inode} "
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if needle not in f.read():
                    continue
        except FileNotFoundError:
            continue  # gone
        except OSError:
            try:
                if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                    continue  # another user's, which cannot open a 0600 segment
            except FileNotFoundError:
                continue
            # one of ours whose map cannot be read (not dumpable): it might be the writer, so
            # its threads count as if it mapped the queue
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError:
            continue  # exited meanwhile: it writes nothing any more
        except (OSError, ValueError):
            return None
        for tid in tids:
            if tid == me:
                continue
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    out[tid] = (state, int(f.read().split()[0]))
            except FileNotFoundError:
                continue  # this thread exited meanwhile
            except (OSError, ValueError, IndexError):
                return None
    return out


def _cannot_be_writing(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> bool:
    """No thread alive in both samples can still be between claim and mark."""
    for tid, (state, ran) in after.items():
        if tid not in before:
            continue  # did not exist when the slot was already claimed
        state0, ran0 = before[tid]
        if ran - ran0 >= RAN_NS or (state0 in "SIZX" and state in "SIZX"):
            continue
        return False
    return True


class Queue:
    """One receive queue of this process, mapped at ``addr``."""

    def __init__(self, addr: int, dev: str, inode: str) -> None:
        self.addr, self.dev, self.inode = addr, dev, inode
        self.flags = np.ctypeslib.as_array((ctypes.c_uint8 * (FIFO_SIZE * ELEM_SIZE)).from_address(addr + _CTL))[::ELEM_SIZE]

    def ends(self) -> tuple[int, int]:
        """``(head, tail)``: the next slot a writer claims, the last one the owner released."""
        return ctypes.c_uint64.from_address(self.addr).value & ~_ARMED, ctypes.c_uint64.from_address(self.addr + 128).value

    def first_unready(self) -> int | None:
        head, tail = self.ends()
        if not 0 < head - tail <= FIFO_SIZE:
            return None
        idx = np.arange(tail, head, dtype=np.uint64)
        ready = (self.flags[idx % FIFO_SIZE] & _OWNER).astype(bool) == ((idx // FIFO_SIZE) & 1).astype(bool)
        bad = np.flatnonzero(~ready)
        return int(idx[bad[0]]) if bad.size else None

    def skip(self, index: int) -> None:
        """Make slot ``index`` an empty message of an unhandled id, then ready. Only this
        process reads it, later, in this thread's order: no fence is needed."""
        elem = self.addr + _CTL + (index % FIFO_SIZE) * ELEM_SIZE
        ctypes.c_uint8.from_address(elem + 1).value = _SKIP_AM_ID
        ctypes.c_uint16.from_address(elem + 2).value = 0
        ctypes.c_uint8.from_address(elem).value = _INLINE | (_OWNER if (index // FIFO_SIZE) & 1 else 0)


#: Held while one of kvxfer's workers is created, so that its queue is told apart from others'.
CREATING = threading.Lock()


def queues() -> set[tuple[int, str, str]] | None:
    """``(address, device, inode)`` of every mapping of this process that has a receive
    queue's name and size, whoever mapped it (nothing in them is read: another library may
    unmap its own at any moment); None without procfs."""
    try:
        with open("/proc/self/maps") as f:
            text = f.read()
    except OSError:
        return None
    return {(int(m[1], 16), m[3], m[4]) for m in _MAPS.finditer(text) if int(m[2], 16) - int(m[1], 16) == _SEG}


def new_queue(before: set[tuple[int, str, str]] | None) -> tuple[int, str, str] | None:
    """The one queue that appeared since ``before`` (taken under :data:`CREATING`, just before
    a worker was created), if its control block names this process: that worker's. None when
    there is not exactly one (another library made a worker meanwhile): that worker is then
    not watched."""
    after = queues()
    if before is None or after is None:
        return None
    new = list(after - before)
    if len(new) != 1 or ctypes.c_int32.from_address(new[0][0] + 136).value != os.getpid():
        return None
    return new[0]


class SlotWatch:
    """Looks at one backend's own receive queues between its progress calls, under its lock."""

    def __init__(self, config: Mapping[str, str], version: tuple[int, ...]) -> None:
        self.active = all(config.get(k) == v for k, v in CONFIG.items()) and tuple(version[:2]) in LAYOUT_VERSIONS
        self.skipped = 0
        self._next = 0.0
        self._suspects: dict[tuple[str, int], tuple[float, dict[int, tuple[str, int]] | None]] = {}

    def check(self, owned: Iterable[tuple[int, str, str] | None]) -> None:
        """Look at the queues ``owned`` (``(address, device, inode)`` of the backend's own live
        workers: only those are known to stay mapped while it holds its lock). A slot unready
        for :data:`SETTLE` s is sampled; one still unready :data:`SETTLE` s later, with no
        thread able to be writing it, is skipped."""
        now = time.monotonic()
        if not (self.active and ENABLED[0]) or now < self._next:
            return
        self._next = now + PERIOD
        seen: dict[tuple[str, int], tuple[float, dict[int, tuple[str, int]] | None]] = {}
        for q in (Queue(*o) for o in owned if o is not None):
            index = q.first_unready()
            if index is None:
                continue
            key = (q.inode, index)
            since, sample = self._suspects.get(key, (now, None))
            if now - since >= SETTLE:
                current = _threads(q.dev, q.inode, threading.get_native_id())
                # Read again after the sample: a writer that ran since has marked its slot by now.
                if (sample is not None and current is not None and _cannot_be_writing(sample, current)
                        and q.first_unready() == index):
                    q.skip(index)
                    self.skipped += 1
                    _log.warning("kvxfer ucx: skipped receive-queue slot %d, left half-written by a process that "
                                 "died (RELIABILITY.md, reversed kill matrix)", index)
                    continue
                since, sample = now, current
            seen[key] = (since, sample)
        self._suspects = seen
