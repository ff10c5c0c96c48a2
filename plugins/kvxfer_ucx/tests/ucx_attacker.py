"""A raw UCX client that holds a victim agent's metadata and goes for memory it was not given.

Run by ``test_ucx_security.py`` as another uid and, as the control, as the victim's own uid
(``--victim`` runs the victim itself, so that both can be one unprivileged user, or so that a
test has a third local process; its option ``fixed`` puts the secret at a chosen address).
It reads a JSON order on stdin: the victim's UCX blob (base64), its pid, the address and size
of a *secret* (unregistered memory to read) and of a *canary* (unregistered memory to write).
It uses no kvxfer policy, only libucp through :mod:`kvxfer_ucx._worker` and raw
``process_vm_readv``/``writev``, so nothing of the victim's own checking stands in its way:

* ``rma``: connect to the victim's worker over the default transports, unpack the victim's
  genuine remote key, GET the secret and PUT a pattern over the canary (UCX does not check a
  remote address against the key's registration: software RMA serves any address);
* ``copy``: ``process_vm_readv`` the secret and ``process_vm_writev`` the canary, as the
  same-host copy path would.

With ``--user NAME`` it drops to that user after loading Python, numpy and libucp (whose
files may sit where the user cannot read them, as root's pyenv does), and before it makes
any UCX context or touches the victim: from then on the kernel sees only that user's
credentials (no capabilities left, checked; dumpable again, as a process the user started
would be). It first proves it works as that user: a GET
from its own worker. Prints one JSON line: what each attempt did and the bytes it read.
"""

from __future__ import annotations

import argparse
import base64
import codecs
import ctypes
import json
import os
import pwd
import sys
import time
from typing import Any

import numpy as np
import numpy.random  # noqa: F401 - its lazy imports need the standard library, which the user may not read

from kvxfer.deadlines import Deadline
from kvxfer.testing.lines import Inbox
from kvxfer_ucx import _libucp as L
from kvxfer_ucx._blob import parse_blob
from kvxfer_ucx._config import transport_config
from kvxfer_ucx._samehost import libc
from kvxfer_ucx._worker import Worker

FILL = 0x5A  # what the attacker's buffer holds before it reads


def drop_to(user: str) -> None:
    """Become ``user`` for good: groups, gid, uid; then check no capability is left."""
    pw = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    # A change of credentials makes the process non-dumpable, which no process that the user
    # starts normally is (and which would shut even same-uid peers out): undo just that.
    if ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise SystemExit(f"PR_SET_DUMPABLE failed: {os.strerror(ctypes.get_errno())}")
    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, _, v in (line.partition(":") for line in f) if k.startswith("Cap")}
    if os.getuid() != pw.pw_uid or os.geteuid() != pw.pw_uid or int(caps["CapEff"], 16) or int(caps["CapPrm"], 16):
        raise SystemExit(f"could not drop to {user}: uid {os.getuid()}, caps {caps}")


def _wait(w: Worker, requests: list[int], seconds: float) -> list[int | None]:
    """Progress until every request settled or ``seconds`` passed; their final statuses."""
    out: list[int | None] = [None] * len(requests)
    deadline = Deadline.within(seconds)
    while time.monotonic() < deadline and any(s is None for s in out):
        w.progress()
        for i, r in enumerate(requests):
            if out[i] is None:
                out[i] = w.reap(r)
    return out


def _rma(w: Worker, ep: int, read: bool, local: np.ndarray, remote: int, packed: bytes) -> dict[str, Any]:
    try:
        rk = w.unpack_rkey(ep, packed)
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        return {"error": f"rkey: {type(exc).__name__}: {exc}"}
    fn = w.lib.ucp_get_nbx if read else w.lib.ucp_put_nbx
    req = fn(ep, local.ctypes.data, local.nbytes, remote, rk, w.param_ref)
    if req and L.is_err_ptr(req):
        return {"error": f"post: {w.status_string(L.status_of_ptr(req))}"}
    flush = w.lib.ucp_ep_flush_nbx(ep, w.param_ref)
    reqs = [r for r in (req, flush) if r and not L.is_err_ptr(r)]
    statuses = _wait(w, reqs, 5.0)
    return {"statuses": [None if s is None else w.status_string(s) for s in statuses],
            "ok": all(s == L.UCS_OK for s in statuses)}


def attack_rma(order: dict[str, Any]) -> dict[str, Any]:
    w = Worker("attacker", transport_config(None, False, None), lambda ep, st: None, lambda h, d: None)
    # proof of life: the same calls against our own worker and memory work as this user
    own_src = np.arange(4096, dtype=np.uint8)
    own_dst = np.zeros(4096, dtype=np.uint8)
    memh, own_key = w.mem_map(own_src.ctypes.data, own_src.nbytes)
    own_ep = w.connect(w.address)
    selftest = _rma(w, own_ep, True, own_dst, own_src.ctypes.data, own_key)
    selftest["bytes_right"] = bool(np.array_equal(own_dst, own_src))
    blob = parse_blob(base64.b64decode(order["blob"]))
    secret = np.full(order["secret"][1], FILL, dtype=np.uint8)
    canary_pattern = np.full(order["canary"][1], 0xC3, dtype=np.uint8)
    out: dict[str, Any] = {"selftest": selftest}
    try:
        ep = w.connect(blob.worker)
    except Exception as exc:  # noqa: BLE001
        out["connect"] = f"{type(exc).__name__}: {exc}"
        out["read_back"] = base64.b64encode(secret.tobytes()).decode()
        return out
    out["connect"] = "ok"
    packed = blob.allocations[0][2]
    out["get"] = _rma(w, ep, True, secret, order["secret"][0], packed)
    out["put"] = _rma(w, ep, False, canary_pattern, order["canary"][0], packed)
    out["read_back"] = base64.b64encode(secret.tobytes()).decode()
    w.mem_unmap(memh)
    return out


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def attack_copy(order: dict[str, Any]) -> dict[str, Any]:
    sys_libc = ctypes.CDLL(None, use_errno=True)
    secret = np.full(order["secret"][1], FILL, dtype=np.uint8)
    canary_pattern = np.full(order["canary"][1], 0xC3, dtype=np.uint8)
    out: dict[str, Any] = {"page_libc": libc() is not None}
    for name, buf, (addr, n) in (("readv", secret, order["secret"]), ("writev", canary_pattern, order["canary"])):
        fn = getattr(sys_libc, f"process_vm_{name}")
        fn.restype = ctypes.c_ssize_t
        loc, rem = _Iovec(buf.ctypes.data, buf.nbytes), _Iovec(addr, n)
        got = fn(order["pid"], ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
        out[name] = got if got >= 0 else os.strerror(ctypes.get_errno())
    out["read_back"] = base64.b64encode(secret.tobytes()).decode()
    return out


def victim(options: dict[str, Any]) -> None:
    """``--victim``: a UCX backend with 4 KiB registered and an unregistered secret and canary.
    Prints the attacker's order, progresses until a line arrives on stdin, then prints the
    secret and canary as they are (base64) and leaves."""
    from kvxfer import Allocation
    from kvxfer_ucx.backend import UcxBackend

    fixed = options.pop("fixed", None)
    be = UcxBackend("victim", **options)
    shared = np.full(4096, 0xAA, dtype=np.uint8)
    be.register([Allocation(shared.ctypes.data, shared.nbytes)])
    secret = np.random.default_rng(21).integers(0, 256, 512, dtype=np.uint8)
    if fixed is not None:  # the secret where another process has memory registered: see fixed_page()
        secret = fixed_page(fixed, secret)
    canary = np.random.default_rng(22).integers(0, 256, 4096, dtype=np.uint8)
    order = {"blob": base64.b64encode(be.local_metadata()).decode(), "pid": os.getpid(),
             "secret": [secret.ctypes.data, secret.nbytes], "canary": [canary.ctypes.data, canary.nbytes]}
    print(json.dumps(order), flush=True)
    try:  # progress until the parent asks for the dump (a line) or goes away (EOF)
        Inbox(sys.stdin.fileno()).line(3600, idle=be.progress, idle_s=0.0005)
    except EOFError:
        be.close()
        return
    print(json.dumps({"secret": base64.b64encode(secret.tobytes()).decode(),
                      "canary": base64.b64encode(canary.tobytes()).decode(),
                      "shared_untouched": bool((shared == 0xAA).all()), "uid": os.getuid()}), flush=True)
    be.close()


def fixed_page(address: int, fill: np.ndarray) -> np.ndarray:
    """A private page mapped at exactly ``address`` (never over an existing mapping), holding
    ``fill``: two processes can so have memory at the same address, one registered and one not."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype, lib.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                            ctypes.c_int, ctypes.c_int, ctypes.c_long]
    # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS|FIXED_NOREPLACE
    got = lib.mmap(address, 4096, 3, 0x02 | 0x20 | 0x100000, -1, 0)
    if got != address:
        raise SystemExit(f"cannot map a page at {address:#x}: {os.strerror(ctypes.get_errno())}")
    page = np.ctypeslib.as_array((ctypes.c_uint8 * 4096).from_address(address))
    page[:len(fill)] = fill
    return page[:len(fill)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", choices=["rma", "copy"])
    ap.add_argument("--user", help="drop to this user before touching UCX or the victim")
    ap.add_argument("--victim", metavar="JSON", help="be the victim instead, with these backend options")
    a = ap.parse_args()
    L.load()  # libucp and its transports are loaded while the files are still readable
    for codec in ("ascii", "utf_8", "latin_1"):  # the standard library may be unreadable to the user
        codecs.lookup(codec)
    if a.victim is not None:
        import kvxfer_ucx.backend  # noqa: F401 - imported while readable, like libucp

        if a.user:
            drop_to(a.user)
        victim(json.loads(a.victim))
        return
    order = json.loads(Inbox(sys.stdin.fileno()).line(120))
    if a.user:
        drop_to(a.user)
    result = attack_rma(order) if a.path == "rma" else attack_copy(order)
    result["uid"] = os.getuid()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
