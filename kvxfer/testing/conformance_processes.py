"""The conformance cases whose peer lives in another process (``python -m kvxfer.testing.peer``).

A backend that claims ``cross_process`` must move bytes, deliver notifications and report a
killed peer across a real process boundary; :class:`TwoProcessConformance` is skipped for
one that does not. Import it from :mod:`kvxfer.testing`.
"""

from __future__ import annotations

import base64
import os
import signal
import tempfile
import threading
import time
from typing import Any

import numpy as np
import pytest

from ..deadlines import Deadline
from ..errors import KvxferError, PeerDisconnectedError, TransferTimeoutError
from .buffers import SENTINEL, Cache, expected_after, make_cache
from .conformance_base import DST_BLOCKS, GEOM, SRC_BLOCKS, _Base
from .peer import PeerProcess, spawn_args


#: Destinations a backend wrote after a transfer's end (a failed stopped-peer case, or its
#: control). The stale request may still be sending: freeing such a cache would let the
#: transport write into memory Python reuses (heap corruption, a crash tests later).
_WRITTEN_AFTER_THE_END: list[Any] = []


class TwoProcessConformance(_Base):
    """The peer lives in another process (``python -m kvxfer.testing.peer``)."""

    peer_timeout: float = 60.0
    peer_args: tuple[str, ...] = ()  # extra ``kvxfer.testing.peer`` arguments, e.g. ("--cuda-device", "1")
    peer_env: dict[str, str] = {}
    #: The peer-killed-mid-transfer cases: ``kill_blocks`` blocks of this geometry (128 MiB),
    #: large enough that the kill lands while bytes flow on NIXL, UCX and sockets, small
    #: enough for a 2-core machine. A backend this fast finishing first is skipped, not passed.
    kill_blocks: int = 64
    kill_geometry: dict[str, int] = {"num_layers": 4, "page": 512 << 10}

    def _spawn(self, cache: str, seed: int | None, name: str = "remote") -> "_PeerProcess":
        return _PeerProcess(self.backend, self.options, self.memory, cache, seed, name, self.peer_timeout,
                            self.peer_args, self.peer_env)

    @pytest.fixture(autouse=True)
    def _skip_same_process_only(self, _skip_unavailable: None) -> None:
        self.require(cross_process=True)

    @pytest.mark.parametrize("remote_kind,local_kind", [("packed", "packed"), ("packed", "layers")])
    def test_read_from_other_process(self, remote_kind: str, local_kind: str) -> None:
        peer = self._spawn(remote_kind, seed=7)
        try:
            dst = make_cache(local_kind, num_blocks=16, memory=self.memory, **GEOM)
            with self.make_agent("local") as agent:
                agent.register(dst.views, replicated=True)
                before = dst.layer_pages()
                name = agent.add_peer(peer.metadata)
                agent.read(name, DST_BLOCKS, SRC_BLOCKS).wait(self.timeout)
                src_pages = peer.pages()
                want = expected_after(before, src_pages, DST_BLOCKS, SRC_BLOCKS)
                np.testing.assert_array_equal(dst.layer_pages(), want)
        finally:
            peer.close()

    def test_write_with_notification(self) -> None:
        """The initiator never polls while the peer waits: the notification must still come."""
        self.require(op="WRITE", notifications=True)
        peer = self._spawn("packed", seed=None)  # remote holds the sentinel
        try:
            src = make_cache("layers", num_blocks=12, memory=self.memory, seed=5, **GEOM)
            with self.make_agent("local") as agent:
                agent.register(src.views, replicated=True)
                name = agent.add_peer(peer.metadata)
                peer.call({"cmd": "add_peer", "metadata": base64.b64encode(agent.metadata()).decode()})
                before, src_before = peer.pages(), src.layer_pages()  # expectations from before the transfer
                want = expected_after(before, src_before, DST_BLOCKS, SRC_BLOCKS)
                t = agent.write(name, SRC_BLOCKS, DST_BLOCKS, notify=b"pushed")
                notes: dict[str, list[str]] = {}
                deadline = Deadline.within(self.timeout)  # the data or the notification, whichever is first;
                while not notes and time.monotonic() < deadline:  # then the other soon after
                    notes = peer.call({"cmd": "notifications", "timeout": 0, "count": 1})["notifications"]
                    if notes or np.array_equal(peer.pages(), want):
                        break
                    time.sleep(0.01)
                if not notes:
                    notes = peer.call({"cmd": "notifications", "timeout": self.notify_timeout,
                                       "count": 1})["notifications"]
                assert {k: [base64.b64decode(m) for m in v] for k, v in notes.items()} == {"local": [b"pushed"]}
                after = peer.pages()  # read only after the notification: data must be visible
                np.testing.assert_array_equal(after, want)
                np.testing.assert_array_equal(src.layer_pages(), src_before, err_msg="WRITE changed its source")
                assert (peer.padding() == SENTINEL).all()
                t.wait(self.timeout)
        finally:
            peer.close()

    def test_standalone_notify_reaches_a_busy_peer(self) -> None:
        """A notification must leave even while the sender does nothing but wait on a pipe."""
        self.require(notifications=True)
        peer = self._spawn("packed", seed=None)
        try:
            cache = make_cache("packed", num_blocks=4, memory=self.memory, **GEOM)
            with self.make_agent("local") as agent:
                agent.register(cache.views, replicated=True)
                name = agent.add_peer(peer.metadata)
                peer.call({"cmd": "add_peer", "metadata": base64.b64encode(agent.metadata()).decode()})
                agent.notify(name, b"ready")
                notes = peer.call({"cmd": "notifications", "timeout": self.notify_timeout, "count": 1})["notifications"]
                assert {k: [base64.b64decode(m) for m in v] for k, v in notes.items()} == {"local": [b"ready"]}
        finally:
            peer.close()

    def test_dead_peer_is_reported_not_waited_on(self) -> None:
        peer = self._spawn("packed", seed=3)
        dst = make_cache("packed", num_blocks=16, memory=self.memory, **GEOM)
        with self.make_agent("local") as agent:
            agent.register(dst.views, replicated=True)
            name = agent.add_peer(peer.metadata)
            agent.read(name, DST_BLOCKS, SRC_BLOCKS).wait(self.timeout)
            peer.kill()
            with pytest.raises(KvxferError) as info:
                for _ in range(50):  # the first posts after a kill may still succeed on some transports
                    agent.read(name, DST_BLOCKS, SRC_BLOCKS).wait(self.timeout)
            assert not isinstance(info.value, TransferTimeoutError), "a dead peer must be detected, not timed out"
            assert isinstance(info.value, PeerDisconnectedError), f"expected PeerDisconnectedError, got {info.value!r}"

    # -- a peer killed while bytes flow (design.md, promise 3) -----------------------------
    def _kill_caches(self, seed: int | None, name: str) -> tuple[_PeerProcess, Cache, list[int], list[int]]:
        n = self.kill_blocks
        peer = _PeerProcess(self.backend, self.options, self.memory, "packed", seed, name, self.peer_timeout,
                            self.peer_args, self.peer_env, blocks=n, geometry=self.kill_geometry)
        local = make_cache("packed", num_blocks=n, memory=self.memory, seed=None if seed is not None else 4711,
                           **self.kill_geometry)
        return peer, local, list(range(n)), list(range(n - 1, -1, -1))

    def _after_kill(self, t: Any, what: str) -> bool:
        """Wait for the transfer after its peer died: True if DONE, False on a typed error."""
        try:
            t.wait(self.timeout)
        except TransferTimeoutError:
            pytest.fail(f"{what}: a peer killed mid-transfer was waited on until the timeout, not detected")
        except KvxferError:
            return False
        return True

    def test_peer_killed_mid_read(self) -> None:
        """Killed while our READ streams its bytes: DONE only with every byte here, else a typed error."""
        peer, dst, ours, theirs = self._kill_caches(seed=31, name="victim")
        try:
            ref = make_cache("packed", num_blocks=self.kill_blocks, seed=31, **self.kill_geometry).layer_pages()
            want = expected_after(dst.layer_pages(), ref, ours, theirs)
            total = dst.num_layers * dst.num_blocks
            with self.make_agent("local") as agent:
                agent.register(dst.views, replicated=True)
                name = agent.add_peer(peer.metadata)
                mid, stop = threading.Event(), threading.Event()

                def watch() -> None:  # a thread: some transports land every byte inside post()
                    while not stop.is_set():
                        reached = dst.pages_reached()
                        if 0 < reached < total:
                            os.kill(peer.pid, signal.SIGKILL)
                            mid.set()
                            return
                        if reached == total:
                            return

                watcher = threading.Thread(target=watch, daemon=True)
                watcher.start()
                try:
                    t = agent.read(name, ours, theirs)
                except KvxferError as exc:  # the kill can land inside post(): a typed error is right
                    stop.set()
                    watcher.join()
                    if not mid.is_set():
                        raise
                    assert not isinstance(exc, TransferTimeoutError)
                    return
                try:
                    while True:  # polled at least once more after the watcher is done
                        if t.done():  # DONE means every byte is here now, not "will be": checked at once
                            reached = dst.pages_reached()
                            assert reached == total, (f"READ reported DONE with {total - reached} of {total} "
                                                      "pages not yet written")
                            break
                        if not watcher.is_alive():
                            break
                        time.sleep(1e-4)  # let the watcher in
                except KvxferError:
                    if not mid.is_set():
                        raise  # failed before the kill: a bug of its own
                stop.set()
                watcher.join()
                peer.kill()
                if self._after_kill(t, "READ"):
                    got = dst.layer_pages()
                    missing = int((got != want).any(axis=2).sum())
                    assert missing == 0, f"READ reported DONE with {missing} of {total} pages wrong after its peer died"
                if not mid.is_set():
                    pytest.skip("the READ finished before its peer could be killed mid-flight: raise kill_blocks")
        finally:
            peer.close()

    def test_peer_killed_mid_write(self) -> None:
        """The peer kills itself once our WRITE has reached some but not all of its pages: the
        write must not then report DONE (its bytes can never all arrive)."""
        self.require(op="WRITE")
        peer, src, ours, theirs = self._kill_caches(seed=None, name="victim")
        try:
            with self.make_agent("local") as agent:
                agent.register(src.views, replicated=True)
                name = agent.add_peer(peer.metadata)
                with tempfile.TemporaryDirectory() as tmp:  # the peer watches before we post
                    ready = os.path.join(tmp, "watching")
                    peer.send({"cmd": "die_mid_transfer", "timeout": self.timeout, "ready_file": ready})
                    deadline = Deadline.within(self.peer_timeout)
                    while not os.path.exists(ready) and peer.proc.poll() is None and time.monotonic() < deadline:
                        time.sleep(0.001)
                try:
                    t = agent.write(name, ours, theirs)
                except KvxferError:  # the peer may die inside post(): then a typed error is right
                    if peer.next_reply(timeout=self.timeout + self.peer_timeout) is not None:
                        raise  # it is alive and answered: the error is a bug of its own
                    return
                seen: dict[str, Any] = {"done": False, "failed": None, "alive_at_done": False}

                def poll() -> None:  # poll the write while waiting for the peer's answer or death
                    if not seen["done"] and seen["failed"] is None:
                        try:
                            seen["done"] = t.done()
                        except KvxferError as exc:  # the peer may already be gone
                            seen["failed"] = exc
                        # A copy engine can finish the rest between the peer's look at a partial
                        # page and its death: DONE seen while it still lived is the truth.
                        seen["alive_at_done"] = bool(seen["done"]) and peer.proc.poll() is None

                poll()
                reply = peer.next_reply(idle=poll, timeout=self.timeout + self.peer_timeout)
                done_first, failed = bool(seen["done"]), seen["failed"]
                if reply is None:  # the peer killed itself with some pages written
                    peer.proc.wait(10)
                    if done_first and seen["alive_at_done"]:
                        pytest.skip("every page landed while the peer lived (it died after a look at a "
                                    "partial page): raise kill_blocks")
                    assert not done_first, "WRITE reported DONE before every page reached its peer"
                    if failed is None:
                        assert not self._after_kill(t, "WRITE"), \
                            "WRITE reported DONE although its peer died before every page arrived"
                    assert not isinstance(failed, TransferTimeoutError), "a dead peer must be detected, not timed out"
                    return
                if failed is not None:
                    raise failed
                assert reply.get("complete"), f"WRITE never reached every page of a live peer: {reply}"
                t.wait(self.timeout)
                pytest.skip("the WRITE finished before its peer could die mid-flight: raise kill_blocks")
        finally:
            peer.close()


    # -- the fence: a stopped peer writes nothing after the end (design.md §7) -------------
    #: How long the READ from a stopped peer is waited on before it times out (``end="timeout"``),
    #: and how long the destination is watched once the peer runs again. A loaded machine can
    #: only shorten what the watch sees, never fail a backend that fences.
    stop_wait: float = 1.0
    stop_watch: float = 1.0

    @pytest.mark.parametrize("end", ["timeout", "cancel"])
    def test_stopped_peer_writes_nothing_after_the_end(self, end: str) -> None:
        """The peer stops (SIGSTOP) with our READ in flight; the READ times out or is cancelled;
        the peer resumes (SIGCONT). Once the READ has reported its end, not one more byte may
        land in its destination: the engine has already reused those blocks."""
        self.require(fence=True)
        peer = self._spawn("packed", seed=41, name="stopped")
        stopped = False
        try:
            dst = make_cache("packed", num_blocks=16, memory=self.memory, **GEOM)
            with self.make_agent("local") as agent:
                agent.register(dst.views, replicated=True)
                name = agent.add_peer(peer.metadata)
                agent.read(name, [15], [1]).wait(self.timeout)  # connected before the peer stops
                before = dst.layer_pages()
                os.kill(peer.pid, signal.SIGSTOP)
                stopped = True
                ended = "an error"
                try:
                    t = agent.read(name, DST_BLOCKS, SRC_BLOCKS)
                    if end == "cancel":
                        t.done()  # polled once, so the request is surely on its way
                        t.cancel()
                    t.wait(self.stop_wait)  # a cancelled transfer raises its cancellation at once
                    ended = "DONE"
                except KvxferError as exc:  # timed out, cancelled, or another typed end
                    ended = type(exc).__name__
                at_end = dst.layer_pages()
                os.kill(peer.pid, signal.SIGCONT)
                stopped = False
                src = peer.pages()  # the peer answers again
                # A fresh READ from the same peer ends DONE with the right bytes (the fence did not
                # break the peer) and has come through whatever the stale request still sends.
                try:
                    agent.read(name, [14], [2]).wait(self.timeout)
                except PeerDisconnectedError:  # a fence that closed the connection may say so: re-add
                    agent.remove_peer(name)
                    name = agent.add_peer(peer.metadata)
                    agent.read(name, [14], [2]).wait(self.timeout)
                deadline = Deadline.within(self.stop_watch)
                while time.monotonic() < deadline and np.array_equal(dst.layer_pages()[:, :14], at_end[:, :14]):
                    agent.progress()
                    time.sleep(0.01)
                after = dst.layer_pages()
                late = int((after[:, :14] != at_end[:, :14]).any(axis=2).sum())
                if late:  # the rest of the stale request may still be on its way: never free its target
                    _WRITTEN_AFTER_THE_END.append(dst)
                assert late == 0, (f"{late} pages of the READ's destination were written after it reported "
                                   f"{ended}: a backend must fence before it reports the end")
                want = expected_after(before, src, DST_BLOCKS + [14], SRC_BLOCKS + [2])
                np.testing.assert_array_equal(after[:, 14], want[:, 14], err_msg="the READ after the resume")
                untouched = [b for b in range(14) if b not in DST_BLOCKS]
                np.testing.assert_array_equal(after[:, untouched], before[:, untouched],
                                              err_msg="blocks outside the READ changed")
                if ended == "DONE":
                    np.testing.assert_array_equal(after[:, DST_BLOCKS], want[:, DST_BLOCKS],
                                                  err_msg="a READ that reported DONE")
        finally:
            if stopped:
                os.kill(peer.pid, signal.SIGCONT)
            peer.close()


class _PeerProcess(PeerProcess):
    """The suite's peer: 12 blocks of the suite's geometry, rows padded with 32 spare bytes."""

    def __init__(self, backend: str, options: dict[str, Any], memory: str, cache: str, seed: int | None, name: str,
                 timeout: float, extra: tuple[str, ...] = (), env: dict[str, str] | None = None, blocks: int = 12,
                 geometry: dict[str, int] | None = None):
        geom = geometry or GEOM
        super().__init__(spawn_args(backend, name=name, cache=cache, memory=memory, blocks=blocks,
                                    layers=geom["num_layers"], page=geom["page"], pad=32 if geometry is None else 0,
                                    options=options, replicated=True, seed=seed) + list(extra), timeout=timeout,
                         env=env)

    def pages(self) -> np.ndarray:
        raw = base64.b64decode(self.call({"cmd": "pages"})["pages"])
        return np.frombuffer(raw, np.uint8).reshape(GEOM["num_layers"], 12, GEOM["page"])

    def padding(self) -> np.ndarray:
        return np.frombuffer(base64.b64decode(self.call({"cmd": "pages"})["padding"]), np.uint8)
