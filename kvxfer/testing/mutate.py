"""Mutations of whole agent metadata, for the fuzz campaign (:mod:`kvxfer.testing.fuzz`).

Two families, because they reach different code:

* **byte-wise** changes to the encoded metadata (bit flips, interesting bytes, inserts,
  deletes, truncation, splices) exercise the framing and JSON layers;
* **structural** changes keep the JSON valid so the input gets past them: the backend's
  connection blob is decoded, mutated byte-wise and re-encoded (what reaches a transport's
  native parser), or one node of the document is replaced with a hostile value (wrong
  types, extreme integers, lone surrogates, deep nesting, long strings).

Everything is drawn from a :class:`random.Random`, so a campaign seed reproduces its inputs.
"""

from __future__ import annotations

import base64
import json
import random
import re
from typing import Any, Callable

__all__ = ["mutate", "MUTATORS"]

MAGIC = b"KVXFMETA"
_INTERESTING = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0xFE, 0x20, 0x22, 0x5C)
_INTERESTING_INTS = (0, 1, -1, 2, 255, 256, 4095, 4096, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
                     1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, -(1 << 63), 1 << 80)


# -- byte-wise ----------------------------------------------------------------------------------
def _flip_bits(rng: random.Random, b: bytearray) -> None:
    for _ in range(rng.randint(1, 8)):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)


def _set_bytes(rng: random.Random, b: bytearray) -> None:
    at = rng.randrange(len(b))
    n = rng.choice((1, 1, 2, 4, 8))
    for i in range(at, min(len(b), at + n)):
        b[i] = rng.choice(_INTERESTING) if rng.random() < 0.6 else rng.randrange(256)


def _insert(rng: random.Random, b: bytearray) -> None:
    at = rng.randrange(len(b) + 1)
    b[at:at] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 2, 4, 16, 64))))


def _delete(rng: random.Random, b: bytearray) -> None:
    at = rng.randrange(len(b))
    del b[at:at + rng.choice((1, 2, 4, 16, 64))]


def _truncate(rng: random.Random, b: bytearray) -> None:
    del b[rng.randrange(len(b)):]


def _splice(rng: random.Random, b: bytearray) -> None:
    n = rng.choice((4, 8, 16, 64))
    src, dst = rng.randrange(len(b)), rng.randrange(len(b))
    chunk = b[src:src + n]
    b[dst:dst + len(chunk)] = chunk


def _zero_run(rng: random.Random, b: bytearray) -> None:
    at = rng.randrange(len(b))
    n = rng.choice((4, 8, 16))
    b[at:at + n] = bytes(min(n, len(b) - at))


BYTE_MUTATORS: tuple[Callable[[random.Random, bytearray], None], ...] = (
    _flip_bits, _set_bytes, _insert, _delete, _truncate, _splice, _zero_run)


def _bytewise(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if not b:
            break
        rng.choice(BYTE_MUTATORS)(rng, b)
    return bytes(b)


# -- structural ----------------------------------------------------------------------------------
def _doc(raw: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(raw[len(MAGIC):])
    except ValueError:
        return None
    return doc if raw.startswith(MAGIC) and isinstance(doc, dict) else None


_DEEP = "\x00kvxfer-deep:"


def _encode(doc: Any) -> bytes:
    text = json.dumps(doc, separators=(",", ":"))
    if "kvxfer-deep:" in text:  # a placeholder for nesting json.dumps itself could not write
        text = re.sub(r'"\\u0000kvxfer-deep:(\d+)"', lambda m: "[" * int(m[1]) + "]" * int(m[1]), text)
    return MAGIC + text.encode("utf-8", "surrogatepass")


def _hostile_value(rng: random.Random) -> Any:
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice(_INTERESTING_INTS)
    if kind == 1:
        return rng.choice((None, True, False, 0.5, -0.0, 1e308, ""))
    if kind == 2:
        return "\ud800" if rng.random() < 0.5 else "x\udc80y"
    if kind == 3:
        return "A" * rng.choice((129, 257, 4096, 65536))
    if kind == 4:  # nesting deeper than any recursive parser should follow
        return f"{_DEEP}{rng.choice((10, 100, 900, 5000, 100_000))}"
    if kind == 5:
        return [rng.choice(_INTERESTING_INTS) for _ in range(rng.choice((1, 3, 5, 1000)))]
    if kind == 6:
        return {"": None, "name": "\ud800", "size": -1}
    if kind == 7:
        return "é\u0000\u202e\uffff"
    if kind == 8:
        return rng.choice(("DRAM", "VRAM", "BLHNC", "nixl", "ucx", "loopback"))
    if kind == 9:
        return base64.b64encode(bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 17, 300))))).decode()
    if kind == 10:
        return -rng.randrange(1 << 20)
    return rng.randrange(1 << rng.choice((8, 16, 32, 48, 64)))


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every value in the document (iterative: documents are small but may be wide)."""
    out, stack = [], [(doc, path)]
    while stack:
        node, p = stack.pop()
        if p:
            out.append(p)
        if isinstance(node, dict):
            stack.extend((v, p + (k,)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, p + (i,)) for i, v in enumerate(node))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _blob_bytes(rng: random.Random, raw: bytes) -> bytes | None:
    """Mutate the backend's connection blob itself: this is what reaches native parsers."""
    doc = _doc(raw)
    if doc is None or not isinstance(doc.get("blob"), str):
        return None
    blob = base64.b64decode(doc["blob"])
    doc["blob"] = base64.b64encode(_bytewise(rng, blob) if blob else b"\0").decode()
    return _encode(doc)


def _replace_node(rng: random.Random, raw: bytes) -> bytes | None:
    doc = _doc(raw)
    if doc is None:
        return None
    paths = _nodes(doc)
    _set(doc, rng.choice(paths), _hostile_value(rng))
    return _encode(doc)


def _nudge_int(rng: random.Random, raw: bytes) -> bytes | None:
    doc = _doc(raw)
    if doc is None:
        return None
    ints = [p for p in _nodes(doc) if type(_get(doc, p)) is int]
    if not ints:
        return None
    p = rng.choice(ints)
    v = _get(doc, p)
    _set(doc, p, rng.choice((v + 1, v - 1, v * 2, v + (1 << 32), v + (1 << 40), -v, v ^ (1 << rng.randrange(64)),
                             rng.choice(_INTERESTING_INTS))))
    return _encode(doc)


def _drop_or_dup(rng: random.Random, raw: bytes) -> bytes | None:
    """Remove a key, or duplicate/drop a list item (counts that disagree with each other)."""
    doc = _doc(raw)
    if doc is None:
        return None
    paths = [p for p in _nodes(doc) if isinstance(_get(doc, p[:-1]) if p[:-1] else doc, (dict, list))]
    p = rng.choice(paths)
    parent = _get(doc, p[:-1]) if p[:-1] else doc
    if isinstance(parent, dict):
        del parent[p[-1]]
    elif rng.random() < 0.5:
        parent.insert(p[-1], json.loads(json.dumps(parent[p[-1]])))
    else:
        del parent[p[-1]]
    return _encode(doc)


STRUCTURAL: tuple[Callable[[random.Random, bytes], bytes | None], ...] = (
    _blob_bytes, _blob_bytes, _blob_bytes, _blob_bytes, _replace_node, _replace_node, _nudge_int, _drop_or_dup)

MUTATORS = {"bytes": _bytewise, **{f.__name__.lstrip("_"): f for f in STRUCTURAL}}


def mutate(rng: random.Random, seed: bytes) -> tuple[str, bytes]:
    """One mutant of ``seed`` and the name of the mutation that made it (for the report)."""
    if rng.random() < 0.25:
        return "bytes", _bytewise(rng, seed)
    f = rng.choice(STRUCTURAL)
    out = f(rng, seed)
    if out is None:
        return "bytes", _bytewise(rng, seed)
    if rng.random() < 0.15:  # stack a second, byte-wise change now and then
        out = _bytewise(rng, out)
    return f.__name__.lstrip("_"), out
