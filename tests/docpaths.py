"""Walk and edit nested JSON-like documents: the tests' tool for corrupting wire data."""

from __future__ import annotations

import copy


def leaves(d: object, path: tuple = ()) -> list[tuple[tuple, object]]:
    """Every ``(path, value)`` in a nested dict/list, containers included, root first."""
    out: list[tuple[tuple, object]] = [(path, d)]
    if isinstance(d, dict):
        for k, v in d.items():
            out += leaves(v, path + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += leaves(v, path + (i,))
    return out


def replaced(d: object, path: tuple, value: object) -> object:
    """A deep copy of ``d`` with the item at ``path`` set to ``value``."""
    if not path:
        return value
    d = copy.deepcopy(d)
    cur = d
    for k in path[:-1]:
        cur = cur[k]  # type: ignore[index]
    cur[path[-1]] = value  # type: ignore[index]
    return d
