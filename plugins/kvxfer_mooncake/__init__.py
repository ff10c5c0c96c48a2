"""kvxfer on Mooncake Transfer Engine: its TCP transport, host memory, peers in any process.

Install with ``apt-get install libibverbs1`` and ``pip install kvxfer-mooncake`` (or
``pip install 'kvxfer[mooncake]'``). Mooncake's ports have no authentication, so an agent
needs ``trusted_network=True``::

    agent = kvxfer.Agent("decode", backend="mooncake", trusted_network=True)

Layout: ``backend.py`` is the seam; ``_blob.py`` the connection blob; ``_bounce.py`` the
transfer arenas (the fence); ``_notify.py`` notifications; ``_engine.py`` loads Mooncake with
its logging and progress timeout set. Why, and what it trusts: ``plugins/kvxfer_mooncake/README.md``. This module does not import Mooncake: listing
backends only looks for it.
"""

from __future__ import annotations

from kvxfer.plugin import RegisterBackend, hookimpl

from ._options import OPTIONS

__all__ = ["kvxfer_register_backends"]

INSTALL = "apt-get install -y libibverbs1 && pip install kvxfer-mooncake"


@hookimpl
def kvxfer_register_backends(register: RegisterBackend) -> None:
    register("mooncake", "kvxfer_mooncake.backend:MooncakeBackend", requires=("mooncake.engine",), install=INSTALL,
             summary="Mooncake Transfer Engine over TCP, DRAM, cross-process (needs trusted_network=True)",
             options=OPTIONS)
