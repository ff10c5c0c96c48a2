"""The cluster tier when Mooncake Store fails under it: a holder killed, a master restarted, eviction.

Each fault ends in a typed miss (a :class:`~kvxfer.errors.StoreMissError`, or its subclass
:class:`~kvxfer.errors.StoreUnavailableError`) and no byte in the cache, checked against the
0xAA sentinel. Each has its control: the same fault with the tier's checks bypassed
(``_verdict`` accepting every fetch) copies what the bounce buffer held, which the control
fills with 0x55 first, into the cache: wrong bytes.
"""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest
from mooncake_fixtures import own_master, worker  # noqa: F401
from store_caches import DIMS, SENTINEL, cache, keys, logical
from test_tier_mooncake import accept_all, expected

from kvxfer.errors import StoreFullError, StoreMissError, StoreUnavailableError
from kvxfer.testing.lines import Channel
from kvxfer.tiers import MooncakeTier

pytestmark = [pytest.mark.multiprocess]

DIMS_ = DIMS["padded"]
X = logical(DIMS_, seed=3)
#: Rows of 64 KiB: 256 fill the smallest segment Mooncake lends (16 MiB).
BIG = (4, 300, 64, 2, 32)


def _control(t: MooncakeTier, monkeypatch: pytest.MonkeyPatch, ks: list[bytes], dims: tuple[int, ...],
             good: np.ndarray) -> None:
    """The fault again, checks bypassed: the bounce's stale bytes land in the cache."""
    monkeypatch.setattr(t, "_verdict", accept_all.__get__(t))
    t._bounce.mem[...] = 0x55
    dst = cache("row", dims)
    t.restore(ks, dst.spec, list(range(len(ks)))).wait()
    assert not np.array_equal(dst.logical()[:, :, :len(ks)], good)
    assert (dst.logical()[:, :, :len(ks)].view(np.uint8) == 0x55).any()


def test_a_segment_holder_killed_mid_restore_is_a_typed_miss(own_master, monkeypatch, tmp_path) -> None:  # noqa: F811
    src_blocks = [2, 9, 4]
    holder = worker(["offload", "--master", own_master.address, "--segment", str(16 << 20), "--seed", "3",
                     "--blocks", ",".join(map(str, src_blocks)), "--tag", "kill-"])
    try:
        assert Channel(holder).read(120) == {"offloaded": 3}
        ks = keys(3, "kill-")
        with MooncakeTier(own_master.address, layout=cache("row", DIMS_).spec, buffer=64 << 10, timeout=10) as t:
            dst = cache("row", DIMS_)
            t.restore(ks, dst.spec, [0, 1, 2]).wait()  # the holder alive: byte-exact
            assert np.array_equal(dst.logical(), expected([0, 1, 2], src_blocks))

            def kill(stage: str) -> None:  # the holder dies between the request and the fetch
                if stage == "issue" and holder.poll() is None:
                    holder.send_signal(signal.SIGKILL)
                    holder.wait(10)

            t._fault = kill
            dst = cache("row", DIMS_)
            with pytest.raises(StoreMissError) as e:
                t.restore(ks, dst.spec, [0, 1, 2]).wait()
            assert e.value.keys and set(e.value.keys) <= set(ks)
            assert dst.untouched([])
            t._fault = None
            _control(t, monkeypatch, ks, DIMS_, X[:, :, src_blocks])
    finally:
        holder.stdin.close()
        holder.kill()
        holder.wait(10)


def _remounted(t: MooncakeTier, src: object) -> None:
    """Wait until the restarted master takes puts again: the client remounts its segment by
    itself (about 1 s); until then a put is refused (unavailable, or no segment yet)."""
    for _ in range(150):
        try:
            t.offload(src.spec, [5], [b"restart-probe"]).wait()  # type: ignore[attr-defined]
            return
        except (StoreUnavailableError, StoreFullError):
            time.sleep(0.1)
    pytest.fail("the client did not remount within 15 s of the master's restart")


def test_a_master_restart_gives_typed_misses_then_recovers(own_master, monkeypatch) -> None:  # noqa: F811
    src = cache("layer", DIMS_, X)
    ks = keys(4, "restart-")
    with MooncakeTier(own_master.address, layout=src.spec, segment=16 << 20, buffer=64 << 10, timeout=10) as t:
        t.offload(src.spec, [0, 1, 2, 3], ks).wait()
        assert t.lookup(ks).all()
        own_master.kill()
        dst = cache("row", DIMS_)
        with pytest.raises(StoreUnavailableError, match="master does not answer"):
            t.restore(ks, dst.spec, [0, 1, 2, 3]).wait()
        with pytest.raises(StoreUnavailableError):
            t.lookup(ks)
        assert dst.untouched([])
        own_master.start()
        _remounted(t, src)
        assert not t.lookup(ks).any()  # the master kept its metadata in memory: every object is gone
        with pytest.raises(StoreMissError) as e:
            t.restore(ks, dst.spec, [0, 1, 2, 3]).wait()
        assert e.value.keys == ks and type(e.value) is StoreMissError
        assert dst.untouched([])
        _control(t, monkeypatch, ks, DIMS_, X[:, :, :4])
        monkeypatch.undo()
        t.offload(src.spec, [0, 1, 2, 3], ks).wait()  # recovery: offload again, restore byte-exact
        t.restore(ks, dst.spec, [3, 2, 1, 0]).wait()
        assert np.array_equal(dst.logical(), expected([3, 2, 1, 0], [0, 1, 2, 3]))


def test_a_full_segments_silent_eviction_is_a_later_typed_miss(own_master, monkeypatch) -> None:  # noqa: F811
    x = logical(BIG, seed=5)
    src = cache("layer", BIG, x)
    ks = keys(BIG[1], "evict-")
    with MooncakeTier(own_master.address, layout=src.spec, segment=16 << 20, buffer=2 << 20, timeout=10) as t:
        refused = 0
        for i in range(0, BIG[1], 25):  # 300 rows of 64 KiB into 16 MiB: Mooncake evicts the oldest
            try:
                t.offload(src.spec, list(range(i, i + 25)), ks[i:i + 25]).wait()
            except StoreFullError:  # a batch that came while eviction had not yet freed room
                refused += 1
        assert refused < BIG[1] // 25 - 4
        held = t.lookup(ks)
        assert not held.all()  # every put above returned 0 or a typed refusal; some objects vanished
        gone = [k for k, h in zip(ks, held.tolist()) if not h][:3]
        dst = cache("row", BIG)
        with pytest.raises(StoreMissError) as e:
            t.restore(gone, dst.spec, [0, 1, 2]).wait()
        assert e.value.keys == gone
        assert dst.untouched([])
        kept = [i for i, h in enumerate(held.tolist()) if h][-3:]
        t.restore([ks[i] for i in kept], dst.spec, [0, 1, 2]).wait()  # what is held still restores
        want = np.full_like(x, 0)
        want.view(np.uint8)[...] = SENTINEL
        want[:, :, [0, 1, 2]] = x[:, :, kept]
        assert np.array_equal(dst.logical(), want)
        _control(t, monkeypatch, gone, BIG, x[:, :, [ks.index(k) for k in gone]])
