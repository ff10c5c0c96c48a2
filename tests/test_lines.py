"""kvxfer.testing.lines: lines split over reads, several lines in one read, and a long reply.

The reader keeps bytes past a line for the next one and searches each read once; these pin
what it hands back, against the lines as they were written.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from kvxfer.testing import lines
from kvxfer._childproc.lines import _Lines

_ECHO = r"""
import sys
from kvxfer.testing import lines
lines.say(sys.stdout, {"hello": True})
lines.serve(lambda cmd: {"echo": cmd["text"], "size": len(cmd["text"])}, lambda: None)
"""


def test_lines_split_anywhere_come_back_whole_and_in_order() -> None:
    docs = [json.dumps({"i": i, "pad": "x" * int(n)}).encode()
            for i, n in enumerate(np.random.default_rng(1).integers(0, 5000, 40))]
    stream = b"".join(d + b"\n" for d in docs)
    cuts = np.sort(np.random.default_rng(2).choice(len(stream), 300, replace=False))
    got: list[bytes] = []
    lines_ = _Lines()
    for chunk in np.split(np.frombuffer(stream, np.uint8), cuts):
        lines_.add(chunk.tobytes())
        while (line := lines_.next()) is not None:
            got.append(line)
    assert got == docs
    assert lines_.next() is None  # nothing left over, nothing made up


def test_a_reply_of_tens_of_megabytes_round_trips() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ch = lines.Channel(proc)
        assert ch.read(60) == {"hello": True}
        text = (np.random.default_rng(3).integers(0, 10, 24 << 20).astype(np.uint8) + ord("0")).tobytes().decode()
        reply = ch.ask({"text": text}, 300)  # a hang guard: 24 MB each way
        assert reply["size"] == len(text) and reply["echo"] == text
        assert ch.ask({"text": "short"}, 60) == {"echo": "short", "size": 5}  # the stream stays aligned
    finally:
        assert ch.stop(60) and proc.returncode == 0


def test_stop_says_when_a_child_did_not_go() -> None:
    """The control of ``stop``: a child that never reads its commands is still running after it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        assert not lines.Channel(proc).stop(0.5)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=60)


_DEAF = r"""
import os, sys, time
os.close(0)  # stops reading: the parent's writes now fail with EPIPE
print("deaf", flush=True)
time.sleep(60)
"""


def test_closing_the_pipes_of_a_child_that_stopped_reading_does_not_raise() -> None:
    """A killed peer leaves the parent's ``exit`` unsent in the pipe's buffer (stop() fails to
    flush it); closing must still close the pipe without raising, or every caller's cleanup
    fails after the kill it was testing."""
    def deaf() -> tuple["subprocess.Popen[str]", lines.Channel]:
        proc = subprocess.Popen([sys.executable, "-c", _DEAF], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "deaf\n"
        return proc, lines.Channel(proc)

    proc, ch = deaf()
    assert ch.stop(1) is False  # the exit could not be sent
    proc.kill()
    proc.wait()
    ch.close()
    assert proc.stdin is not None and proc.stdin.closed

    proc, ch = deaf()  # the control: the plain close of that stdin raises
    ch.stop(1)
    proc.kill()
    proc.wait()
    assert proc.stdin is not None
    try:
        proc.stdin.close()
    except BrokenPipeError:
        raised = True
    else:
        raised = False
    proc.stdout.close()  # type: ignore[union-attr]
    assert raised


def test_a_parent_holding_over_1024_descriptors_still_reads_replies() -> None:
    """An engine holds thousands of descriptors, so its children's pipes are numbered past 1,024:
    the channel waits with ``poll`` (kvxfer.deadlines.readable). Control: ``select`` refuses the
    same descriptor, which is how the channel failed before."""
    import os
    import resource
    import select

    import pytest

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        proc = subprocess.Popen([sys.executable, "-c", _ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            ch = lines.Channel(proc)
            assert ch._fd >= 1024
            with pytest.raises(ValueError):
                select.select([ch._fd], [], [], 0)
            assert ch.read(60) == {"hello": True}
            assert ch.ask({"text": "x" * 10}, 60) == {"echo": "x" * 10, "size": 10}
        finally:
            assert ch.stop(60) and proc.returncode == 0
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
