"""Hosts on one machine: network namespaces joined by veth pairs (iproute2), for fault tests.

:class:`NetLab` creates one namespace per node and one veth pair per link, each link with a
private /24 of ``10.213.<link>.0`` that exists only inside the two namespaces it joins
(the machine's own namespace never routes to it, and no traffic leaves the machine). Every
node also has its own loopback, so a test can check that bytes went over the link and not
over ``lo``. Links can be cut and restored (``ip link set down/up``) and shaped (``tc``
token-bucket rate), which is what the link-cut tests need; processes run inside a node with
:meth:`NetLab.popen` (``ip netns exec``).

Everything is removed on :meth:`NetLab.close` (also on errors, as a context manager, and at
interpreter exit): processes still running in the namespaces are killed by pid, then the
namespaces are deleted, which deletes their veths. Needs root (CAP_NET_ADMIN) and the
``ip`` binary; :func:`unavailable_reason` says why a machine cannot run it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["NetLab", "Link", "unavailable_reason"]

SUBNET = "10.213"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r


def unavailable_reason() -> str | None:
    """Why namespaces cannot be created here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2 is not installed (apt-get install -y iproute2, or: make deps)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN); run the tests as root"
    probe = f"kvx-probe-{uuid.uuid4().hex[:8]}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"'ip netns add' failed here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    index: int

    def address(self, node: str) -> str:
        return f"{SUBNET}.{self.index}.{1 if node == self.a else 2}"

    def ifname(self, node: str) -> str:
        """Name of ``node``'s end: ``to-<other node>`` (at most 15 characters)."""
        return f"to-{self.b if node == self.a else self.a}"[:15]


class NetLab:
    """Namespaces ``nodes`` joined by ``links`` (pairs of node names)."""

    def __init__(self, nodes: Sequence[str], links: Sequence[tuple[str, str]]) -> None:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.tag = uuid.uuid4().hex[:6]
        self.nodes = list(nodes)
        self.links = [Link(a, b, i) for i, (a, b) in enumerate(links)]
        self._procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        atexit.register(self.close)
        try:
            for n in self.nodes:
                _ip("netns", "add", self.ns(n))
                self._made.append(self.ns(n))
                _ip("-n", self.ns(n), "link", "set", "lo", "up")
            for link in self.links:
                _ip("link", "add", "name", link.ifname(link.a), "netns", self.ns(link.a), "type", "veth",
                    "peer", "name", link.ifname(link.b), "netns", self.ns(link.b))
                for node in (link.a, link.b):
                    _ip("-n", self.ns(node), "addr", "add", f"{link.address(node)}/24", "dev", link.ifname(node))
                    _ip("-n", self.ns(node), "link", "set", link.ifname(node), "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "NetLab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ns(self, node: str) -> str:
        if node not in self.nodes:
            raise KeyError(f"no node {node!r} (nodes: {self.nodes})")
        return f"kvx-{self.tag}-{node}"

    def link(self, a: str, b: str) -> Link:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        raise KeyError(f"no link between {a!r} and {b!r}")

    def address(self, node: str, toward: str) -> str:
        """``node``'s address on its link to ``toward``."""
        return self.link(node, toward).address(node)

    def ifname(self, node: str, toward: str) -> str:
        return self.link(node, toward).ifname(node)

    # -- processes ----------------------------------------------------------------------------
    def popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``node``'s namespace; it is killed by :meth:`close` if still running."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], **kwargs)
        self._procs.append(p)
        return p

    def run(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        kwargs.setdefault("timeout", 60)
        return subprocess.run(["ip", "netns", "exec", self.ns(node), *argv], **kwargs)

    # -- faults and measurements --------------------------------------------------------------
    def set_link(self, a: str, b: str, up: bool) -> None:
        """Bring ``a``'s end of the a-b link down or up (the peer end loses carrier with it)."""
        _ip("-n", self.ns(a), "link", "set", self.ifname(a, b), "up" if up else "down")

    def shape(self, a: str, b: str, rate: str | None) -> None:
        """Limit what ``a`` sends toward ``b`` to ``rate`` (tc syntax, e.g. ``"200mbit"``); None removes it."""
        dev = self.ifname(a, b)
        if rate is None:
            self.run(a, ["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            return
        r = self.run(a, ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "64kb",
                         "latency", "1s"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"tc could not shape {dev} in {self.ns(a)}: {r.stderr.strip()}")

    def counters(self, node: str, ifname: str) -> dict[str, int]:
        """``rx_bytes``/``tx_bytes`` of an interface inside ``node`` (``lo`` included)."""
        out = _ip("-n", self.ns(node), "-s", "-j", "link", "show", "dev", ifname).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"])}

    # -- cleanup ------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what runs in the namespaces (by pid), then delete them. Idempotent."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        self._procs.clear()
        for ns in self._made:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # started by us inside our own namespace (grandchildren included)
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        atexit.unregister(self.close)
