"""Which processes of this host a UCX worker address names, read exactly as UCX reads it.

A NIXL or UCX-backend blob carries its agent's UCX worker address, opaque bytes that this
process's UCX (the releases of :data:`kvxfer.ucxabi.VALIDATED`, whose packed layout is the
same) will follow: into another process's memory through
cross-memory attach, into its receive queue through shared memory, into this very process
through the loopback transports. So the address is parsed here the way UCX parses it
(``ucp_address_unpack``: packed worker address version 1 or 2, non-unified mode), entry by
entry, and each entry tells whom it reaches:

* ``cma`` and ``cuda_ipc``: a pid (with UCX's PID-namespace flag and namespace);
* ``posix``: the pid inside its FIFO's segment id (``/proc/<pid>/fd/<fd>`` mode);
* ``sysv``: a System V segment, whose creator the kernel lists in ``/proc/sysvipc/shm``;
* ``self``, ``cuda_copy``, ``gdr_copy``: an interface id, which reaches this process only
  when it is one of this process's own ids;
* network and RDMA transports (``tcp``, InfiniBand, EFA): no process by pid.

An entry reaches this host only if UCX here would find it reachable: a shared-memory entry
needs this host's system id and IPC namespace in its device address, a pid needs this
process's PID namespace, and a transport this process's UCX does not have is never used.
What cannot be told (a layout that does not parse, a transport that is present here but
unknown to this table, a shared-memory entry whose owner cannot be read) raises
:class:`Unreadable`; ``docs/design.md`` section 8.2 says why that is refused.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

__all__ = ["SM_DEVICE", "TRANSPORTS", "Address", "Entry", "Here", "Reach", "Unreadable", "crc16", "parse", "reach",
           "shm_owners"]


class Unreadable(ValueError):
    """The address (or one entry that could reach this host) cannot be read exactly."""


def crc16(name: str) -> int:
    """UCX's transport-name checksum (CRC-16, reflected polynomial 0x8408, complemented)."""
    crc = 0xFFFF
    for byte in name.encode():
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x8408 if crc & 1 else 0)
    return ~crc & 0xFFFF


_PID = ("cma", "cuda_ipc")
_SHM = ("posix", "sysv", "xpmem")
_LOOPBACK = ("self", "cuda_copy", "gdr_copy", "rocm_copy", "ze_copy", "gaudi_gdr")
_NETWORK = ("tcp", "rc_verbs", "ud_verbs", "rc_mlx5", "dc_mlx5", "ud_mlx5", "gga_mlx5", "rc_gda", "rc_gdp", "srd",
            "knem", "ugni_rdma", "ugni_smsg", "ugni_udt")  # knem: its keys are kernel cookies, no pid
#: transport-name checksum -> name, for every transport the validated UCX releases define
TRANSPORTS = {crc16(n): n for n in _PID + _SHM + _LOOPBACK + _NETWORK}
SM_DEVICE = ("cma", "posix", "sysv", "xpmem")  # device address: system id, then IPC namespace

_MAX_ENTRIES, _MAX_EPS = 128, 64  # UCP_MAX_RESOURCES, UCP_MAX_LANES
_V1_ATTR, _V2_ATTR = 16, 8  # packed iface attributes of address versions 1 and 2
_NS_FLAG_DEVICE = 1 << 63  # system id flag: an IPC namespace follows
_NS_FLAG_CMA = 1 << 31
_POSIX_PROCFS, _POSIX_PID_NS = 1 << 63, 1 << 60
_DEFAULT_IPC_NS, _DEFAULT_PID_NS = 0xEFFFFFFF, 0xEFFFFFFC  # what UCX assumes without a namespace
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class Entry:
    """One transport interface of the address: its transport and the bytes UCX connects to."""

    csum: int
    device: bytes
    iface: bytes
    at: int = 0  # where ``iface`` starts in the address

    @property
    def transport(self) -> str | None:
        return TRANSPORTS.get(self.csum)


@dataclass(frozen=True)
class Address:
    version: int  # 1 or 2
    uuid: int
    entries: tuple[Entry, ...]


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise Unreadable(f"cut short at byte {self.pos} (wanted {n} more)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def extended(self, first: int, mask: int, v2: bool) -> int:
        """A length or index packed in the bits ``mask`` of ``first``; all ones in v2: the next byte."""
        value = first & mask
        return self.byte() if v2 and value == mask else value


def parse(address: bytes) -> Address:
    """The entries of a packed UCX worker address; :class:`Unreadable` unless it parses exactly."""
    c = _Cursor(bytes(address))
    head = c.byte()
    if head & 0x0F not in (0, 1):
        raise Unreadable(f"address version {head & 0x0F}")
    v2 = head & 0x0F == 1
    flags = c.byte() if v2 else head >> 4
    uuid = _U64.unpack(c.take(8))[0] if (not v2 or flags & 0x2) else 0
    if flags & 0x4:  # client id
        c.take(8)
    if flags & 0x1:  # debug info: the worker's name
        c.take(c.byte())
    entries: list[Entry] = []
    if c.data[c.pos:c.pos + 1] == b"\xff":  # no devices at all
        c.take(1)
    else:
        while True:
            md = c.byte()
            empty = bool(md & 0x80)
            c.extended(md, 0x7F, v2)
            dev = c.byte()
            dev_len = c.extended(dev, 0x1F, v2)
            if dev & 0x40:  # number of paths
                c.take(1)
            if dev & 0x20:  # system device
                c.take(1)
            device = c.take(dev_len)
            last_tl = empty
            while not last_tl:
                if len(entries) >= _MAX_ENTRIES:
                    raise Unreadable(f"more than {_MAX_ENTRIES} interfaces")
                csum = int.from_bytes(c.take(2), "little")
                c.take(_V2_ATTR if v2 else _V1_ATTR)
                ln = c.byte()
                last_tl, has_ep = bool(ln & 0x80), bool(ln & 0x40)
                iface = c.take(c.extended(ln, 0x3F, v2))
                at = c.pos - len(iface)
                for n_eps in range(_MAX_EPS + 1):
                    if not has_ep:
                        break
                    if n_eps == _MAX_EPS:
                        raise Unreadable(f"more than {_MAX_EPS} endpoint addresses")
                    c.take(c.byte())
                    has_ep = not c.byte() & 0x80
                entries.append(Entry(csum, device, iface, at))
            if dev & 0x80:
                break
    if c.pos != len(c.data):
        raise Unreadable(f"{len(c.data) - c.pos} bytes after the last device")
    return Address(2 if v2 else 1, uuid, tuple(entries))


@dataclass
class Here:
    """What this process's own UCX offers, read from its own agents' worker addresses."""

    pid: int
    pid_ns: int  # inode of this process's PID namespace (0: unknown)
    entries: dict[str, list[Entry]] = field(default_factory=dict)  # transport -> this process's entries
    uuids: set[int] = field(default_factory=set)
    unknown: set[int] = field(default_factory=set)  # checksums of transports offered here, unknown to the table

    def add(self, own_address: bytes) -> None:
        parsed = parse(own_address)
        self.uuids.add(parsed.uuid)
        for e in parsed.entries:
            if e.transport is None:
                self.unknown.add(e.csum)
            else:
                self.entries.setdefault(e.transport, []).append(e)


@dataclass(frozen=True)
class Reach:
    """Whom on this host an address reaches: pids, and whether this process itself."""

    pids: frozenset[int]
    this_process: bool  # through a loopback interface id or worker uuid of this process


def reach(address: bytes, here: Here, owner_of_shm: "dict[int, int] | None" = None) -> Reach:
    """The processes of this host that ``address`` names, as this process's UCX would reach them.

    ``owner_of_shm`` maps System V segment ids to their creators (read from ``/proc`` unless
    given)."""
    parsed = parse(address)
    pids: set[int] = set()
    this_process = parsed.uuid in here.uuids
    for e in parsed.entries:
        name = e.transport
        ours = here.entries.get(name or "", [])
        if name is None and e.csum in here.unknown:
            raise Unreadable(f"transport checksum {e.csum:#06x} is offered here but unknown to this parser")
        if not ours:
            continue  # a transport this process's UCX does not have: it never connects through it
        if name in _LOOPBACK:
            this_process |= any(e.iface[:8] == o.iface[:8] for o in ours)
        elif name in SM_DEVICE:
            if not any(_same_sm_device(e.device, o.device) for o in ours):
                continue
            if name == "cma":
                pid = _pid_in(e.iface, _NS_FLAG_CMA, 4, here)
            elif name == "posix":
                pid = _posix_pid(e.iface, here)
            elif name == "sysv":
                pid = _sysv_owner(e.iface, owner_of_shm)
                pid = pid if owner_of_shm is not None or _in_pid_ns(pid, here) else None
            else:
                raise Unreadable(f"a {name} entry reaches this host, and its owner cannot be read")
            if pid is not None:
                pids.add(pid)
        elif name == "cuda_ipc":
            if len(e.device) >= 8 and any(e.device[:8] == o.device[:8] for o in ours):
                pid = _pid_in(e.iface, 0, 4, here, cuda=True)
                if pid is not None:
                    pids.add(pid)
    return Reach(frozenset(pids), this_process)


def _same_sm_device(peer: bytes, mine: bytes) -> bool:
    """UCX's same-host test: equal system id, and equal IPC namespace when one is packed."""
    if len(peer) < 8:
        raise Unreadable(f"a shared-memory device address of {len(peer)} bytes")
    (sid,) = _U64.unpack_from(peer)
    if sid & _NS_FLAG_DEVICE and len(peer) < 12:
        raise Unreadable("a shared-memory device address with a namespace flag and no namespace")
    n = 12 if sid & _NS_FLAG_DEVICE else 8
    return len(mine) >= n and peer[:n] == mine[:n]


def _pid_in(iface: bytes, flag: int, size: int, here: Here, cuda: bool = False) -> int | None:
    """A pid packed as u32 (``flag`` set: a PID namespace follows); None if in another namespace."""
    if len(iface) < size:
        raise Unreadable(f"a pid-bearing interface address of {len(iface)} bytes")
    (raw,) = _U32.unpack_from(iface)
    if cuda:  # cuda_ipc: pid, then (since UCX 1.19) always the namespace
        pid, ns = raw, (_U32.unpack_from(iface, 4)[0] if len(iface) >= 8 else _DEFAULT_PID_NS)
    elif raw & flag:
        if len(iface) < size + 4:
            raise Unreadable("a pid with a namespace flag and no namespace")
        pid, ns = raw & ~flag, _U32.unpack_from(iface, size)[0]
    else:
        pid, ns = raw, _DEFAULT_PID_NS
    return pid if _same_pid_ns(ns, here) else None


def _same_pid_ns(ns: int, here: Here) -> bool:
    return not here.pid_ns or ns == (here.pid_ns & 0xFFFFFFFF)


def _in_pid_ns(pid: int, here: Here) -> bool:
    """Whether ``pid`` (as this process sees it) lives in this PID namespace; yes when unreadable.

    The kernel shows a segment's creator by its pid here even when it runs in a child
    namespace, where the same process calls itself otherwise: such a pid cannot be compared
    with what its header claims (``docs/design.md`` section 8.2, limits)."""
    try:
        return not here.pid_ns or os.stat(f"/proc/{pid}/ns/pid").st_ino == here.pid_ns
    except OSError:
        return True


def _posix_pid(iface: bytes, here: Here) -> int | None:
    if len(iface) < 8:
        raise Unreadable(f"a posix interface address of {len(iface)} bytes")
    (seg,) = _U64.unpack_from(iface)
    if not seg & _POSIX_PROCFS:
        raise Unreadable("a posix FIFO named by a file, not by its owner's pid (UCX_POSIX_USE_PROC_LINK=n)")
    ns = _DEFAULT_PID_NS
    if seg & _POSIX_PID_NS:
        if len(iface) < 12:
            raise Unreadable("a posix FIFO with a namespace flag and no namespace")
        ns = _U32.unpack_from(iface, 8)[0]
    return seg & 0x3FFFFFFF if _same_pid_ns(ns, here) else None


def _sysv_owner(iface: bytes, owners: "dict[int, int] | None") -> int:
    if len(iface) < 8:
        raise Unreadable(f"a sysv interface address of {len(iface)} bytes")
    (shmid,) = _U64.unpack_from(iface)
    table = shm_owners() if owners is None else owners
    if shmid not in table:
        raise Unreadable(f"System V segment {shmid} does not exist on this host")
    return table[shmid]


def shm_owners() -> dict[int, int]:
    """System V segment id -> creator pid, as this IPC namespace's kernel lists them."""
    out: dict[int, int] = {}
    try:
        with open("/proc/sysvipc/shm", encoding="ascii") as f:
            next(f, None)
            for line in f:
                cols = line.split()
                if len(cols) >= 5:
                    out[int(cols[1])] = int(cols[4])
    except (OSError, ValueError) as exc:
        raise Unreadable(f"cannot read this host's System V segments ({exc})") from None
    return out
