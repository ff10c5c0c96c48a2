"""Open file descriptors: the limit transports run into, raised once and named when reached.

NIXL keeps descriptors per peer (RELIABILITY.md: a peer re-added often adds up), an engine
holds thousands of its own, and the default soft limit is often 1,024. At the limit native
code fails with whatever its own error is (NIXL says ``NIXL_ERR_BACKEND``), which reads as a
bad peer. So the first agent of a process raises the soft limit to the hard one (and logs
it), and ``add_peer`` near the limit is refused as what it is:
:class:`~kvxfer.errors.DescriptorLimitError`, with the count and the limit. It is refused
*before* the transport sees the peer: a NIXL agent whose UCX endpoint creation ran out of
descriptors kept that peer "unreachable" after the descriptors came back (RELIABILITY.md,
"A peer added at the descriptor limit stayed unreachable"); checked after a failure as well.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

from .errors import DescriptorLimitError

__all__ = ["raise_soft_limit", "in_use", "near_limit", "limit_error"]

log = logging.getLogger("kvxfer")
#: Descriptors that must stay free for a call to count as not starved of them.
MARGIN = 32
_raised = False
_lock = threading.Lock()


def _limits() -> tuple[int, int] | None:
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_soft_limit() -> None:
    """Once per process: soft ``RLIMIT_NOFILE`` up to the hard limit (a no-op where it is)."""
    global _raised
    with _lock:
        if _raised:
            return
        _raised = True
    lim = _limits()
    if lim is None:
        return
    soft, hard = lim
    if soft == hard:
        return
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.info("kvxfer: open-file limit stays at %d (raising it to %d failed: %s)", soft, hard, exc)
        return
    log.info("kvxfer: open-file limit raised from %d to %d (transports hold descriptors per peer)", soft, hard)


def in_use() -> int | None:
    """Descriptors open in this process, where ``/proc`` (or ``/dev/fd``) tells.

    Listing them takes a descriptor itself: at the limit the listing fails with ``EMFILE``,
    which says as much as a count would (every descriptor is in use).
    """
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d)) - 1  # the listing's own descriptor
        except OSError as exc:
            if exc.errno == errno.EMFILE:
                lim = _limits()
                return lim[0] if lim is not None else None
            continue
    return None


def near_limit() -> tuple[int, int] | None:
    """``(open, soft limit)`` when fewer than :data:`MARGIN` descriptors are left, else None."""
    lim, n = _limits(), in_use()
    if lim is None or n is None or lim[0] < 0:
        return None
    return (n, lim[0]) if lim[0] - n < MARGIN else None


def limit_error(what: str) -> DescriptorLimitError | None:
    """The error to raise for a failure of ``what``, if descriptors ran out; None otherwise."""
    near = near_limit()
    if near is None:
        return None
    return DescriptorLimitError(f"{what}: this process has {near[0]} of {near[1]} file descriptors open "
                                "(RLIMIT_NOFILE); raise the limit (ulimit -n) or hold fewer peers", *near)
