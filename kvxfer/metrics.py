"""Prometheus metrics for kvxfer transfers: ``pip install 'kvxfer[metrics]'``.

::

    from kvxfer.metrics import start_exporter
    exporter = start_exporter(port=9464)      # serves /metrics; exporter.close() stops it

or, inside an application that already serves Prometheus, register the observer alone::

    from kvxfer.metrics import PrometheusObserver
    from kvxfer.observe import add_observer
    add_observer(PrometheusObserver(registry=my_registry))

Per transfer (labels: backend, op, mode = the plan's shape, path = the backend's data path;
counters also by status): transfers, bytes and
descriptors moved, and histograms of descriptors per transfer and of plan, post and total
seconds. The observer is a kvxfer plugin object, so it sees every agent of the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import MissingDependencyError
from .extras import install_hint
from .plugin.hookspecs import hookimpl

__all__ = ["PrometheusObserver", "Exporter", "start_exporter", "INSTALL"]

INSTALL = install_hint("metrics")
_DESC_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
_SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise MissingDependencyError(f"Prometheus metrics need prometheus-client; install it with: {INSTALL}") \
            from None
    return prometheus_client


class PrometheusObserver:
    """Counts and histograms of finished transfers, in ``registry`` (the default one if None)."""

    def __init__(self, registry: Any = None, namespace: str = "kvxfer") -> None:
        pc = _prometheus()
        if registry is None:
            registry = pc.REGISTRY
        self.registry = registry
        labels = ["backend", "op", "mode", "path"]
        kw = {"namespace": namespace, "registry": registry}
        self.transfers = pc.Counter("transfers", "Finished transfers", labels + ["status"], **kw)
        self.bytes = pc.Counter("transfer_bytes", "Bytes moved by completed transfers", labels, **kw)
        self.descriptors = pc.Counter("transfer_descriptors", "Descriptors posted by completed transfers",
                                      labels, **kw)
        self.descriptors_per_transfer = pc.Histogram(
            "descriptors_per_transfer", "Descriptors in one transfer", labels, buckets=_DESC_BUCKETS, **kw)
        self.seconds = pc.Histogram("transfer_seconds", "First post until done", labels,
                                    buckets=_SECONDS_BUCKETS, **kw)
        self.plan_seconds = pc.Histogram("plan_seconds", "Planning and list preparation per transfer", labels,
                                         buckets=_SECONDS_BUCKETS, **kw)
        self.post_seconds = pc.Histogram("post_seconds", "Handing a transfer's posts to the backend", labels,
                                         buckets=_SECONDS_BUCKETS, **kw)

    @hookimpl
    def kvxfer_transfer_finished(self, transfer: Any, stats: Any) -> None:
        lv = (stats.backend, stats.op, stats.mode, stats.path or "")
        self.transfers.labels(*lv, transfer.status.value.lower()).inc()
        self.plan_seconds.labels(*lv).observe(stats.plan_seconds)
        if transfer.status.value != "DONE":
            return
        self.bytes.labels(*lv).inc(stats.nbytes)
        self.descriptors.labels(*lv).inc(stats.descriptors)
        self.descriptors_per_transfer.labels(*lv).observe(stats.descriptors)
        self.post_seconds.labels(*lv).observe(stats.post_seconds)
        if stats.seconds is not None:
            self.seconds.labels(*lv).observe(stats.seconds)


@dataclass
class Exporter:
    """A running ``/metrics`` endpoint and the observer feeding it."""

    observer: PrometheusObserver
    host: str
    port: int
    _server: Any
    _thread: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        from .observe import remove_observer

        remove_observer(self.observer)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_exporter(port: int = 9464, host: str = "127.0.0.1", *, registry: Any = None) -> Exporter:
    """Serve kvxfer metrics over HTTP on ``host:port`` (``port=0`` picks a free one).

    Binds to localhost unless told otherwise: metrics name peers and backends.
    """
    from .observe import add_observer

    pc = _prometheus()
    observer = PrometheusObserver(registry=registry)
    server, thread = pc.start_http_server(port, addr=host, registry=observer.registry)
    add_observer(observer, name=f"kvxfer-metrics-{id(observer):x}")
    return Exporter(observer, host, int(server.server_port), server, thread)
