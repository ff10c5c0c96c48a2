"""kvxfer: move LLM KV-cache blocks between inference workers with as few descriptors as the
two sides' layouts allow.

Quick start (two agents in one process, the in-process loopback backend)::

    import numpy as np, kvxfer
    prefill = kvxfer.Agent("prefill", backend="loopback")
    decode = kvxfer.Agent("decode", backend="loopback")
    prefill.register({"kv": np.zeros((64, 4096), np.uint8)})
    decode.register({"kv": np.zeros((64, 4096), np.uint8)})
    peer = decode.add_peer(prefill.metadata())
    decode.read(peer, [0, 1], [5, 6]).wait(timeout=5)

Importing kvxfer imports neither torch nor any transport library: backends are loaded from
the ``kvxfer`` entry-point group when first used.
"""

from __future__ import annotations

from . import errors
from .agent import Agent, Peer
from .plugin.backend import Backend, Capabilities
from .errors import *  # noqa: F403
from .plugin.hookspecs import hookimpl
from .geometry import spec_from_arrays, spec_from_pointers, spec_from_tensors
from .pairing import check_pairing, spec_diff
from .geometry import KNOWN_LAYOUTS, Granularity, KVCacheSpec, Member, PackedLayout, Region
from .memory import Allocation, DescriptorList, MemoryKind, Op
from .metadata import AgentMetadata
from .geometry import PageFormat, Shard
from .pairing import Pairing, pair
from .planner import Leg, TransferPlan, plan
from .plugin.registry import BackendStatus, available_backends
from .transfer import Status, Transfer, TransferStats
from .owned import OwnedFuture, OwnedTransfer
from .owner import Owner
from .store import Store

__version__ = "0.1.0"

#: What README.md and docs/ use (tests/test_public_api.py keeps the two equal). The other names
#: imported above stay importable here, for code written against them, but their home is their
#: package: ``kvxfer.geometry``, ``kvxfer.pairing``, ``kvxfer.plugin``, ``kvxfer.memory``,
#: ``kvxfer.errors``, ``kvxfer.transfer``, ``kvxfer.owned``, ``kvxfer.metadata``, ``kvxfer.planner``.
__all__ = ["Agent", "KvxferError", "Owner", "Store", "Transfer", "errors", "hookimpl", "plan", "spec_from_tensors"]
