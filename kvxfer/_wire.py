"""The wire toolkit: one bounded reader for binary formats and one set of typed JSON field readers.

Every format kvxfer reads from a peer (metadata, backend blobs, process identities, directory
values, side-channel frames, digests, vLLM parameters) is hostile until parsed. Each used to
carry its own cursor and its own ``_text``/``_int`` helpers, with rules that drifted apart.
Here they are written once, so a rule tightened here is tightened for every format.

One rule for text (:func:`text`): a ``str`` that encodes as UTF-8 (a lone surrogate from a
``\\ud800`` escape would raise later, wherever the name is logged or handed to C), of 1 to
``limit`` UTF-8 *bytes* (the bound that matters to the buffers it lands in, not the number of
characters), and printable (``str.isprintable``: no NUL, no control or line-separator
character, so a peer's name cannot truncate a C string, forge a log line or drive a terminal).

One rule for integers (:func:`integer`): an integral value, never a ``bool`` (``True == 1`` in
Python, and a ``True`` offset is always a bug), inside ``[lo, hi]``.

Every failure is a :class:`kvxfer.errors.KvxferError` of the type the caller names (a format
keeps its own error type: :class:`MetadataError` for peers' bytes, ``ParamsError`` for vLLM
parameters), and nothing else escapes: no ``struct.error``, ``IndexError`` or ``RecursionError``.
"""

from __future__ import annotations

import base64
import binascii
import json
import numbers
import struct
from typing import Any, Final, NoReturn

from .errors import KvxferError, MetadataError

__all__ = ["Reader", "U32", "U64", "b64", "integer", "keys", "load_json", "text", "U64_MAX"]

U32: Final = struct.Struct("<I")
U64: Final = struct.Struct("<Q")
U64_MAX: Final = (1 << 64) - 1
ErrorType = type[KvxferError]


class Reader:
    """A cursor over untrusted bytes: every read is checked against the end before it is made.

    ``what`` names the format and its sender in every error (``"NIXL metadata of 'p'"``), and
    the byte offset of the failure is appended, so a refusal says where the bytes went wrong.
    """

    __slots__ = ("data", "pos", "what", "error")

    def __init__(self, data: bytes | bytearray | memoryview, what: str, error: ErrorType = MetadataError) -> None:
        self.data, self.pos, self.what, self.error = bytes(data), 0, what, error

    def bad(self, why: str) -> KvxferError:
        return self.error(f"{self.what} is malformed at byte {self.pos}: {why}")

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes; refuses a read past the end (never a short result)."""
        if not 0 <= n <= self.left:
            raise self.bad(f"{n} bytes wanted, {self.left} left")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size))

    def expect(self, raw: bytes) -> None:
        if self.data[self.pos:self.pos + len(raw)] != raw:
            raise self.bad(f"expected {raw[:32]!r}")
        self.pos += len(raw)

    def field(self, tag: bytes, limit: int, *, length: struct.Struct = U64, end: bytes = b"",
              exact: int | None = None, empty: bool = True) -> bytes:
        """One tag-length-value record: ``tag``, a ``length``-packed size, the value, then ``end``.

        The size is checked against ``limit`` (and ``exact``) before a byte of the value is
        touched, so a hostile length costs nothing.
        """
        self.expect(tag)
        if self.left < length.size:
            raise self.bad(f"record {tag!r} is cut short")
        (n,) = length.unpack_from(self.data, self.pos)
        start = self.pos + length.size
        if n > limit or (exact is not None and n != exact) or (not empty and n == 0) \
                or start + n + len(end) > len(self.data) or self.data[start + n:start + n + len(end)] != end:
            raise self.bad(f"record {tag!r} has a bad length ({n})")
        self.pos = start + n + len(end)
        return self.data[start:start + n]

    def rest(self) -> bytes:
        out = self.data[self.pos:]
        self.pos = len(self.data)
        return out

    def done(self) -> None:
        """Refuse trailing bytes: what a parser did not read, a native reader might."""
        if self.left:
            raise self.bad(f"{self.left} bytes after the last field")


def _fail(error: ErrorType, msg: str) -> NoReturn:
    raise error(msg)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        raise ValueError("duplicate keys")
    return doc


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number")


def _encodable(doc: Any) -> None:
    """Every key and string must encode as UTF-8 (only a ``\\u`` escape can make one that does not)."""
    stack = [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            x.encode("utf-8")
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())


def load_json(data: bytes | bytearray | memoryview, what: str, *, limit: int, error: ErrorType = MetadataError,
              max_items: int | None = None, duplicates: bool = False) -> Any:
    """Strict JSON from untrusted bytes: bounded size (and item count, counted before parsing),
    UTF-8, no NaN or Infinity, no duplicate keys (unless ``duplicates``), every string encodable.

    Duplicate keys are refused because two parsers may keep different ones of a pair.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        _fail(error, f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > limit:
        _fail(error, f"{what} is {len(data)} bytes, over the {limit} limit")
    raw = bytes(data)
    if max_items is not None:
        items = raw.count(b",") + raw.count(b"[") + raw.count(b"{")  # an upper bound, counted in C
        if items > max_items:
            _fail(error, f"{what} holds up to {items} JSON items, over the {max_items} limit")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant,
                         object_pairs_hook=None if duplicates else _no_duplicates)
        if b"\\u" in raw:
            _encodable(doc)
    except (UnicodeError, ValueError, RecursionError) as exc:
        _fail(error, f"{what} is not valid UTF-8 JSON: {exc}")
    return doc


def keys(doc: Any, want: frozenset[str] | set[str], what: str, error: ErrorType = MetadataError) -> dict[str, Any]:
    """``doc`` as an object with exactly the keys ``want`` (unknown keys are refused: a peer that
    sends a field we ignore believes it said something we did not hear)."""
    if not isinstance(doc, dict) or set(doc) != set(want):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        _fail(error, f"{what} must be an object with keys {sorted(want)}, got {got}")
    return doc


def text(value: Any, what: str, limit: int, error: ErrorType = MetadataError) -> str:
    """The one rule for text (module docstring): UTF-8, 1..``limit`` bytes, printable."""
    if type(value) is str and value.isprintable():
        try:
            if 0 < len(value.encode("utf-8")) <= limit:
                return value
        except UnicodeEncodeError:
            pass
    _fail(error, f"{what} must be a printable UTF-8 string of 1..{limit} bytes")


def integer(value: Any, what: str, lo: int = 0, hi: int = U64_MAX, error: ErrorType = MetadataError, *,
            integral: bool = False) -> int:
    """The one rule for integers (module docstring): an ``int``, not a bool, in ``[lo, hi]``.

    ``integral`` also takes other integral types (numpy's), for values from a caller rather
    than from JSON: the result is always a Python ``int``.
    """
    if type(value) is not int:
        if isinstance(value, bool) or not (integral and isinstance(value, numbers.Integral)) \
                and not isinstance(value, int):
            _fail(error, f"{what} must be an integer, got {type(value).__name__}")
        value = int(value)
    if not lo <= value <= hi:
        _fail(error, f"{what}={value} is outside [{lo}, {hi}]")
    return value


def b64(value: Any, what: str, limit: int, error: ErrorType = MetadataError, *, empty: bool = False) -> bytes:
    """Strict base64 text of at most ``limit`` decoded bytes (bounded before decoding)."""
    if not isinstance(value, str) or not (empty or value) or len(value) > 4 * ((limit + 2) // 3):
        _fail(error, f"{what} must be a {'' if empty else 'non-empty '}base64 string of at most {limit} bytes")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, binascii.Error, UnicodeEncodeError):
        _fail(error, f"{what} is not valid base64")
