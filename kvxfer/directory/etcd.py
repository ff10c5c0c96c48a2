"""The directory on etcd, through its grpc-gateway (JSON over HTTP) with ``etcd3gw``.

``pip install 'kvxfer[etcd]'``. Why this client and not NIXL's own etcd support:
docs/directory.md. Unary calls (lease grant, keep-alive and revoke, put, conditional delete,
range) go through ``etcd3gw``; the watch stream is read here, because ``etcd3gw``'s watcher
has no connect deadline and does not report when its stream ends, and a directory that
silently stops hearing about departures is worse than none.

Each thread gets its own client (``requests`` sessions are not shared across threads), and
each call gets the caller's remaining time as its socket timeout: connect and every read are
bounded, so an etcd that is down, cut off or stuck answers with
:class:`DirectoryUnavailableError` by the deadline.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

from ..errors import BackendUnavailableError
from ..extras import install_hint
from .base import Directory, OnChange, Store, StoredItem
from .entry import DirectoryError, DirectoryUnavailableError, LeaseLostError, ResyncNeeded
from .keys import prefix_end

__all__ = ["EtcdStore", "EtcdDirectory", "INSTALL"]

INSTALL = install_hint("etcd")
#: Largest watch message accepted (a full metadata record is at most 16 MiB, base64 adds 1/3).
MAX_WATCH_LINE = 64 << 20

T = TypeVar("T")


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode("utf-8") if isinstance(data, str) else data).decode("ascii")


def _unb64(data: Any) -> bytes:
    if not isinstance(data, str):
        raise ValueError("expected a base64 string")
    return base64.b64decode(data, validate=True)



def _leased(kv: dict[str, Any]) -> bool:
    """Whether etcd holds the record under a lease (it omits the field for lease 0)."""
    try:
        return int(kv.get("lease", 0) or 0) != 0
    except (TypeError, ValueError):
        return False

class EtcdStore(Store):
    """One etcd endpoint (``http://host:port``; ``https://`` with the TLS options)."""

    def __init__(self, endpoint: str = "http://127.0.0.1:2379", *, api_path: str = "/v3/", ca_cert: str | None = None,
                 cert_key: str | None = None, cert_cert: str | None = None) -> None:
        try:
            import requests
            from etcd3gw import exceptions, lease
            from etcd3gw.client import Etcd3Client
        except ImportError as exc:
            raise BackendUnavailableError(f"the etcd directory needs etcd3gw ({exc}); install it with: {INSTALL}") from None
        self._client_cls, self._gwx, self._gwlease, self._requests = Etcd3Client, exceptions, lease, requests
        url = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"etcd endpoint {endpoint!r} must look like http://host:port")
        self.endpoint = f"{url.scheme}://{url.netloc}"
        self._args = dict(host=url.hostname, port=url.port or 2379, protocol=url.scheme, ca_cert=ca_cert,
                          cert_key=cert_key, cert_cert=cert_cert, api_path=api_path)
        self._local = threading.local()
        self._sessions: list[Any] = []
        self._sessions_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<EtcdStore {self.endpoint}>"

    def _client(self) -> Any:
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._client_cls(**self._args)
            self._local.client = c
            with self._sessions_lock:
                self._sessions.append(c.session)
        return c

    def _call(self, what: str, deadline: float, fn: Callable[[Any], T]) -> T:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DirectoryUnavailableError(f"deadline passed before etcd {what} ({self.endpoint})")
        client = self._client()
        client.timeout = left
        gwx = self._gwx
        try:
            return fn(client)
        except (gwx.ConnectionFailedError, gwx.ConnectionTimeoutError) as exc:
            raise DirectoryUnavailableError(f"etcd at {self.endpoint} did not answer {what} in time or refused the "
                                            f"connection: {exc.detail_text}") from None
        except gwx.Etcd3Exception as exc:
            text = str(exc.detail_text or exc)
            if "lease not found" in text:
                raise LeaseLostError(f"etcd no longer knows our lease ({what})") from None
            raise DirectoryError(f"etcd at {self.endpoint} refused {what}: {text[:500]}") from None
        except self._requests.RequestException as exc:
            raise DirectoryUnavailableError(f"etcd at {self.endpoint} failed during {what}: {exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise DirectoryError(f"etcd at {self.endpoint} answered {what} with something unexpected: {exc}") from None

    # -- Store ------------------------------------------------------------------------------
    def grant(self, ttl: int, deadline: float) -> int:
        return self._call("lease grant", deadline, lambda c: int(c.lease(ttl).id))

    def keepalive(self, lease: int, deadline: float) -> bool:
        return self._call("lease keep-alive", deadline, lambda c: self._gwlease.Lease(lease, c).refresh() > 0)

    def revoke(self, lease: int, deadline: float) -> None:
        try:
            self._call("lease revoke", deadline, lambda c: self._gwlease.Lease(lease, c).revoke())
        except LeaseLostError:
            pass  # already gone: nothing left to revoke

    def put(self, key: str, value: bytes, lease: int, deadline: float) -> None:
        self._call("put", deadline, lambda c: c.put(key, value, lease=self._gwlease.Lease(lease, c)))

    def delete_if(self, key: str, value: bytes, deadline: float) -> None:
        txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}],
               "success": [{"request_delete_range": {"key": _b64(key)}}], "failure": []}
        self._call("conditional delete", deadline, lambda c: c.transaction(txn))

    def range(self, prefix: str, deadline: float) -> tuple[list[StoredItem], int]:
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}

        def run(c: Any) -> tuple[list[StoredItem], int]:
            res = c.post(c.get_url("/kv/range"), json=body)
            items: list[StoredItem] = [(_unb64(kv["key"]), _unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)))
                                       for kv in res.get("kvs", []) if _leased(kv)]
            return items, int(res["header"]["revision"])

        return self._call("range", deadline, run)

    def watch(self, prefix: str, start_revision: int, on_change: OnChange, stop: threading.Event,
              idle: float, connect_deadline: float) -> int:
        req = self._requests
        connect = connect_deadline - time.monotonic()
        if connect <= 0:
            raise DirectoryUnavailableError(f"deadline passed before opening the etcd watch ({self.endpoint})")
        client = self._client()
        create = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                     "start_revision": start_revision}}
        rev, created = start_revision, False
        try:
            resp = client.session.post(client.get_url("/watch"), json=create, stream=True, timeout=(connect, idle))
        except req.RequestException as exc:
            raise DirectoryUnavailableError(f"cannot open a watch on etcd at {self.endpoint}: {exc}") from None
        with resp:
            if resp.status_code != 200:
                raise DirectoryUnavailableError(f"etcd at {self.endpoint} refused the watch: HTTP {resp.status_code}")
            buf = b""
            try:
                for chunk in resp.iter_content(chunk_size=None):
                    buf += chunk
                    if len(buf) > MAX_WATCH_LINE:
                        raise DirectoryError(f"a watch message from etcd exceeds {MAX_WATCH_LINE} bytes")
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        if line.strip():
                            rev = self._watch_message(line, rev, on_change)
                            created = True
                    if stop.is_set():
                        return rev
            except req.exceptions.ConnectionError as exc:
                if created and "timed out" in str(exc).lower():
                    return rev  # quiet for `idle` seconds: the caller opens a fresh stream
                raise DirectoryUnavailableError(f"the etcd watch stream from {self.endpoint} broke: {exc}") from None
            except req.RequestException as exc:
                raise DirectoryUnavailableError(f"the etcd watch stream from {self.endpoint} broke: {exc}") from None
        raise DirectoryUnavailableError(f"etcd at {self.endpoint} closed the watch stream")

    @staticmethod
    def _watch_message(line: bytes, rev: int, on_change: OnChange) -> int:
        try:
            doc = json.loads(line)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            if "error" in doc:
                raise DirectoryUnavailableError(f"etcd ended the watch: {str(doc['error'])[:300]}")
            res = doc.get("result") or {}
            if res.get("canceled") or int(res.get("compact_revision", 0) or 0) > 0:
                raise ResyncNeeded("etcd no longer has the changes since our last revision")
            changes = []
            for ev in res.get("events", []):
                kv = ev["kv"]
                kind = "delete" if ev.get("type") == "DELETE" or not _leased(kv) else "put"
                value = _unb64(kv.get("value", "")) if kind == "put" else None
                changes.append((kind, _unb64(kv["key"]), value, int(kv["mod_revision"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise DirectoryError(f"unexpected watch message from etcd: {exc}") from None
        for kind, key, value, r in changes:
            on_change(kind, key, value, r)
            rev = max(rev, r + 1)
        return rev

    def close(self) -> None:
        with self._sessions_lock:
            sessions, self._sessions = self._sessions, []
        for s in sessions:
            s.close()


class EtcdDirectory(Directory):
    """:class:`~kvxfer.directory.Directory` on etcd.

    ``EtcdDirectory("http://10.0.0.5:2379", cluster="llama-70b", ttl=10, timeout=5)``; TLS
    with ``ca_cert``, ``cert_key`` and ``cert_cert`` (etcd can map the client certificate to
    a user with permissions on the cluster's prefix).
    """

    def __init__(self, endpoint: str = "http://127.0.0.1:2379", cluster: str = "default", *, ttl: float = 10.0,
                 timeout: float = 5.0, token: bytes | str | None = None, api_path: str = "/v3/",
                 ca_cert: str | None = None, cert_key: str | None = None, cert_cert: str | None = None) -> None:
        store = EtcdStore(endpoint, api_path=api_path, ca_cert=ca_cert, cert_key=cert_key, cert_cert=cert_cert)
        super().__init__(store, cluster, ttl=ttl, timeout=timeout, token=token)
        self.endpoint = store.endpoint
