"""The discovery options, checked before any of them is used.

``Agent.register`` passes what a user typed straight through, so every option is refused
typed here (``InvalidArgumentError`` for a wrong type, ``SpecError`` for a value that would
describe the cache wrongly) before discovery walks a single tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Union

import numpy as np

from ..errors import InvalidArgumentError, SpecError
from ._spec import MAX_ALLOCATIONS, MAX_MEMBERS, Member

__all__ = ["Replication", "check_options", "check_pointer_members", "check_spans", "check_tp", "is_int",
           "replicated_heads", "replication"]

Replication = Union[bool, Iterable[str], Callable[[str], bool]]


def replication(replicated: Replication) -> Callable[[str], bool]:
    if isinstance(replicated, (bool, np.bool_)):
        return lambda _n: bool(replicated)
    if callable(replicated):
        return lambda n: bool(replicated(n))  # type: ignore[operator]
    if isinstance(replicated, (str, bytes)) or not isinstance(replicated, Iterable):
        raise InvalidArgumentError(f"replicated is True/False, a set of member names or a predicate, "
                                   f"got {type(replicated).__name__}")
    names = {n for n in replicated if isinstance(n, str)}
    if len(names) != sum(1 for _ in replicated):
        raise InvalidArgumentError("replicated names members by strings")
    return lambda n: n in names or n.rsplit(".", 1)[0] in names


def replicated_heads(name: str, h: int | None, tp_size: int, kv_heads: int | None) -> None:
    """Refuse a replicated page with a heads axis under TP when nothing says it holds every head.

    If it were one rank's share, "identical on every rank" would pair ranks holding different
    heads and move wrong heads without an error. ``kv_heads`` is the statement (checked against
    the page by the caller), and a page whose dims name no heads axis is not split by heads.
    """
    if h is not None and tp_size > 1 and kv_heads is None:
        raise SpecError(f"{name}: replicated=True with tp_size={tp_size}, but its page has a heads axis ({h} "
                        "heads) and nothing says it holds every KV head; pass kv_heads= (the model's KV heads: "
                        "accepted when the page holds all of them), or register GQA/MHA pages without "
                        "replicated=True (replicated=True is for pages identical on every rank: MLA, indexer)")


def check_options(layout: object, block_tokens: object, kv_dim: object, dims: object, kv_heads: object) -> None:
    """Types of the discovery options, before any of them is used."""
    for name, v, hi in (("block_tokens", block_tokens, 1 << 24), ("kv_dim", kv_dim, 64), ("kv_heads", kv_heads, 1 << 16)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidArgumentError(f"{name} must be an integer or None, got {type(v).__name__}")
        if not (0 if name == "kv_dim" else 1) <= v <= hi:
            raise SpecError(f"{name}={v} is out of range")
    if layout is not None and not isinstance(layout, str):
        raise InvalidArgumentError(f"layout must be a string or None, got {type(layout).__name__}")
    if dims is not None and not isinstance(dims, (str, Mapping)):
        raise InvalidArgumentError(f"dims must be a string of letters or a mapping per entry, got {type(dims).__name__}")


def is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_spans(spans: object) -> list[tuple[int, int, int]]:
    """``(pointer, nbytes, device)`` spans, each three integers; at most a spec's allocations."""
    if not isinstance(spans, (list, tuple)) or not 0 < len(spans) <= MAX_ALLOCATIONS or not all(
            isinstance(s, (list, tuple)) and len(s) == 3 and all(is_int(v) and 0 <= v < 1 << 64 for v in s)
            for s in spans):
        raise InvalidArgumentError(f"spans are (pointer, nbytes, device) tuples of integers, 1 to {MAX_ALLOCATIONS} "
                                   f"of them, got {spans!r:.80}")
    return [(int(s[0]), int(s[1]), int(s[2])) for s in spans]


def check_pointer_members(members: object) -> list[Member | tuple[str, int]]:
    """Members as :class:`Member` objects or ``(name, size)`` pairs; at most a spec's members."""
    if not isinstance(members, (list, tuple)) or not 0 < len(members) <= MAX_MEMBERS or not all(
            isinstance(m, Member) or (isinstance(m, (list, tuple)) and len(m) == 2 and isinstance(m[0], str)
                                      and is_int(m[1]) and 0 < m[1] < 1 << 63) for m in members):
        raise InvalidArgumentError(f"members are Member objects or (name, size) pairs, 1 to {MAX_MEMBERS} of them, "
                                   f"got {members!r:.80}")
    return list(members)


def check_tp(tp_rank: object, tp_size: object) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` checked: a TP size above 1 without a rank would claim rank 0's heads."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or not 1 <= tp_size <= 1 << 16:
        raise SpecError(f"tp_size must be an integer from 1 to 65536, got {tp_size!r}")
    if tp_rank is None:
        if tp_size > 1:
            raise SpecError(f"tp_size={tp_size} needs tp_rank= (this worker's rank, 0 to {tp_size - 1}); without it "
                            "the pages would be registered as rank 0's heads")
        return 0, 1
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, (int, np.integer)) or not 0 <= tp_rank < tp_size:
        raise SpecError(f"tp_rank must be an integer from 0 to {int(tp_size) - 1}, got {tp_rank!r}")
    return int(tp_rank), int(tp_size)
