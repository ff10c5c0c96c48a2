"""kvxfer's one home for talking to a child process, in one of two codecs.

* **Frames** (:mod:`.frames`): ``kind | length | payload`` over pipes, for helpers that load
  untrusted bytes in native code (:mod:`kvxfer.prove`, the fuzz worker); replies are bounded,
  and the wait counts the CPU time a helper was given, not the wall clock.
* **JSON lines** (:mod:`.lines`): a command per line and a reply per line, for test peers,
  attackers and benchmark children; every read has a deadline.

Both wait through :func:`kvxfer.deadlines.readable` (``poll``, not ``select``), and no other
module reads a child's pipe by hand: ``tests/test_children.py`` fails on a ``readline`` of a
pipe, a ``select.select`` or a ``for line in proc.stdout`` anywhere else, since each such loop
was a hang waiting for a child that died or stopped.
"""

from __future__ import annotations

from .frames import (FRAME, MAX_INPUT, MAX_REPLY, NATIVE_FAULTS, PINNING_ENV, Child, Clock, ask, child_env, end,
                     read_exact, unpin_self)
from .frames import serve as serve_frames
from .lines import Channel, Inbox, say
from .lines import serve as serve_lines

__all__ = ["Channel", "Child", "Clock", "FRAME", "Inbox", "MAX_INPUT", "MAX_REPLY", "NATIVE_FAULTS", "PINNING_ENV",
           "ask", "child_env", "end", "read_exact", "say", "serve_frames", "serve_lines", "unpin_self"]
