"""What kvxfer reads of UCX's own internals, in one home, with the UCX releases each was checked against.

Two layouts are not UCX API and change when UCX does:

* the packed **worker address** (:mod:`.address`), read to tell which processes of this host
  a peer's address reaches (the NIXL and UCX backends' identity checks);
* the shared-memory **receive queue** (:mod:`.mmqueue`), whose half-written slot left by a
  killed writer the UCX backend skips.

:data:`VALIDATED` names, for each layout, the UCX releases (major, minor) it was checked
against; nothing else in the tree names a UCX version. ``tests/test_ucx_versions.py`` fails when
an installed UCX (the ``libucx`` wheel's, or one bundled with NIXL) is a release a layout has
not been checked against, and says which layout to validate and how.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from typing import Mapping

__all__ = ["HOW_TO_VALIDATE", "READ_BY", "VALIDATED", "installed_libucp", "libucp_version", "unvalidated",
           "validated"]

#: layout -> UCX releases (major, minor) it was checked against.
VALIDATED: Mapping[str, frozenset[tuple[int, int]]] = {
    # ucp_address_unpack, address versions 1 and 2: 1.23 (bundled with NIXL 1.5.1), 1.21 (libucx-cu12)
    "worker address": frozenset({(1, 21), (1, 23)}),
    # uct_mm_fifo_ctl_t and uct_mm_fifo_element_t, uct_mm_ep_am_common_send: 1.21 (libucx-cu12)
    "receive queue": frozenset({(1, 21)}),
}
#: backend -> the layouts it reads of the UCX it loads (the stuck-slot watch is the UCX backend's).
READ_BY: Mapping[str, tuple[str, ...]] = {"ucx": ("worker address", "receive queue"), "nixl": ("worker address",)}
#: What to run before adding a release to :data:`VALIDATED` (each layout's own tests).
HOW_TO_VALIDATE: Mapping[str, str] = {
    "worker address": "compare ucp_address_unpack/ucp_address_pack_* of the new release with kvxfer/ucxabi/address.py "
                      "and run plugins/kvxfer_nixl/tests/test_ucx_address.py and plugins/kvxfer_ucx/tests/"
                      "test_ucx_rma_bounds.py against it",
    "receive queue": "compare uct_mm_fifo_ctl_t, uct_mm_fifo_element_t and uct_mm_ep_am_common_send of the new release "
                     "with kvxfer/ucxabi/mmqueue.py and run plugins/kvxfer_ucx/tests/test_ucx_stuckslot.py and "
                     "`ucx_kill_matrix.py --reverse` (with and without --control-wedge) against it",
}


def validated(layout: str, version: tuple[int, ...]) -> bool:
    """Whether ``layout`` was checked against UCX ``version`` (its major and minor)."""
    return tuple(version[:2]) in VALIDATED[layout]


def unvalidated(version: tuple[int, ...], backend: str = "ucx") -> list[str]:
    """The layouts ``backend`` reads that were not checked against UCX ``version``."""
    return [layout for layout in READ_BY[backend] if not validated(layout, version)]


def installed_libucp() -> dict[str, str]:
    """``{path: backend}`` for every ``libucp`` a backend of this environment may load: the
    ``libucx`` wheel's (the UCX backend's) and the ones bundled with NIXL's wheels (found by
    file name; nothing is loaded here)."""
    found = {}
    for backend, pkg, pattern in (("ucx", "libucx", "lib/libucp.so*"),
                                  ("nixl", "nixl_cu12", "../nixl_cu12.libs/libucp*.so*"),
                                  ("nixl", "nixl_cu13", "../nixl_cu13.libs/libucp*.so*"),
                                  ("nixl", "nixl", "../nixl.libs/libucp*.so*")):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            hits = sorted(glob.glob(os.path.join(root, pattern)), key=len)
            if hits:
                found[os.path.realpath(hits[0])] = backend
    return found


def libucp_version(path: str) -> tuple[int, int, int]:
    """``ucp_get_version`` of the library at ``path``. Loads it: call in a process of its own
    where two UCX builds must not meet (each is its own ``libucp.so.0``)."""
    lib = ctypes.CDLL(path)
    v = [ctypes.c_uint() for _ in range(3)]
    lib.ucp_get_version(*(ctypes.byref(x) for x in v))
    return v[0].value, v[1].value, v[2].value
