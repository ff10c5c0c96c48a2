"""Two hosts on one machine: offload on one network namespace, restore on another, one master.

Host ``a`` runs the ``mooncake_master`` and a client that lends its segment and offloads;
host ``b`` restores over the veth between them (kvxfer._harness.netns), so the rows cross a
network link and not the machine's loopback. The bytes are compared with numpy indexing over
the logical array (tests/store_caches.py). Needs root and iproute2; elsewhere it skips and
says why.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from mooncake_fixtures import require_mooncake, worker
from test_tier_mooncake import expected

from kvxfer.testing.lines import Channel
from kvxfer.testing.mooncake_master import MooncakeMaster
from kvxfer._harness.netns import NetLab, unavailable_reason

pytestmark = [pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    require_mooncake()
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with NetLab(["a", "b"], [("a", "b")]) as lab:
        yield lab


def test_offload_on_one_host_restore_on_another_through_one_master(lab: NetLab, tmp_path) -> None:
    a, b = lab.address("a", "b"), lab.address("b", "a")
    src_blocks, dst_blocks = [7, 1, 20, 12, 3], [0, 23, 4, 9, 16]
    with MooncakeMaster(host=a, netns=lab.ns("a"), lease_ms=1500, client_ttl=2) as m:
        holder = worker(["offload", "--master", m.address, "--hostname", a, "--segment", str(16 << 20),
                         "--seed", "3", "--blocks", ",".join(map(str, src_blocks)), "--tag", "ns-"],
                        popen=lambda argv, **kw: lab.popen("a", argv, **kw))
        try:
            assert Channel(holder).read(120) == {"offloaded": 5}
            rx = lab.counters("b", lab.ifname("b", "a"))["rx_bytes"]
            out = tmp_path / "restored.npy"
            r = worker(["restore", "--master", m.address, "--hostname", b, "--blocks", ",".join(map(str, dst_blocks)),
                        "--tag", "ns-", "--out", str(out)], popen=lambda argv, **kw: lab.popen("b", argv, **kw))
            assert json.loads(r.communicate(timeout=60)[0].strip().splitlines()[-1]) == {"error": None}
            assert np.array_equal(np.load(out), expected(dst_blocks, src_blocks))
            # The rows (5 x 2624 bytes) came over the veth from host a.
            assert lab.counters("b", lab.ifname("b", "a"))["rx_bytes"] - rx >= 5 * 2624
        finally:
            holder.stdin.close()
            holder.wait(30)
