"""Spec files: one worker's KV geometry written down as TOML or JSON.

A spec file describes a model's cache as an engine allocates it (layers, the pages each
layer keeps per block, their dtypes and heads, block size, page order) and where this
worker sits in tensor and pipeline parallelism. :class:`Geometry` turns that into a
:class:`~kvxfer.KVCacheSpec` through discovery (:mod:`kvxfer.geometry._views` describes the
tensors an engine would register, at a fake address, for planning;
:func:`~kvxfer.spec_from_arrays` for real byte buffers), so a file can never describe
something the library would not accept from tensors, and pairs exactly as they would.
Every mistake is a :class:`~kvxfer.errors.SpecFileError` naming the file and the key.

The format, with the defaults shown (``docs/spec-files.md`` has complete MLA, GQA and hybrid
Mamba examples)::

    name = "my-model"
    layers = 61                # model layers, before any pipeline split
    block_tokens = 64
    layout = "BLHNC"           # page order: BL* one row per block, LB* one region per layer

    [parallel]
    tp_size = 1
    tp_rank = 0
    pp_size = 1
    pp_rank = 0

    [[groups]]
    layers = "all"             # or "3-47/4", "0-2,5", [0, 1, 2], "rest" (layers no other group has)
    [[groups.members]]
    name = ""                  # member "layer.{i}"; else "layer.{i}.{name}"
    dtype = "bfloat16"
    heads = 1                  # KV heads of the whole model; split over TP unless replicated
    head_dim = 576             # or shape = [...] for a multi-dimensional state
    per_token = true           # false: a fixed-size state per block (Mamba, conv)
    replicated = false         # true: every TP rank holds the same bytes (MLA latent)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

from ..errors import SpecError, SpecFileError
from ._discover import spec_from_arrays
from ._kinds import DTYPES, LayerGroup, MemberKind
from ._spec import KNOWN_LAYOUTS, KVCacheSpec
from ._views import geometry_spec

__all__ = ["DTYPES", "FAKE_BASE", "MemberKind", "LayerGroup", "Geometry", "load", "loads"]

#: Address planning-only specs pretend to live at; they are never registered.
FAKE_BASE = 0x7F00_0000_0000
MAX_LAYERS = 4096


@dataclass(frozen=True)
class Geometry:
    """A worker's KV geometry; build specs or buffers from it.

    ``members`` lists this worker's pages in row order (layer by layer) as
    ``(name, bytes per block, replicated)``: only the layers of its pipeline stage, with
    head-split pages cut to its tensor-parallel share.
    """

    name: str
    num_layers: int
    block_tokens: int
    groups: tuple[LayerGroup, ...]
    layout: str = "BLHNC"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    description: str = ""
    members: tuple[tuple[str, int, bool], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layout not in KNOWN_LAYOUTS:
            raise SpecError(f"layout: unknown {self.layout!r}; known: {', '.join(KNOWN_LAYOUTS)}")
        for key, lo, hi in (("tp_size", 1, 1 << 16), ("pp_size", 1, MAX_LAYERS), ("block_tokens", 1, 1 << 24),
                            ("num_layers", 1, MAX_LAYERS)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise SpecError(f"{key}: expected an integer in [{lo}, {hi}], got {v!r}")
        for key, size in (("tp_rank", self.tp_size), ("pp_rank", self.pp_size)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < size:
                raise SpecError(f"{key}: expected 0 <= {key} < {size}, got {v!r}")
        if self.pp_size > self.num_layers:
            raise SpecError(f"pp_size {self.pp_size} is larger than the {self.num_layers} layers")
        owner: dict[int, int] = {}
        for gi, g in enumerate(self.groups):
            for layer in g.layers:
                if not 0 <= layer < self.num_layers:
                    raise SpecError(f"groups[{gi}]: layer {layer} is outside 0..{self.num_layers - 1}")
                if layer in owner:
                    raise SpecError(f"groups[{gi}]: layer {layer} is already in groups[{owner[layer]}]")
                owner[layer] = gi
        missing = sorted(set(range(self.num_layers)) - owner.keys())
        if missing:
            raise SpecError(f"layers {_ranges(missing)} belong to no group")
        out = []
        for layer in self.stage_layers:
            for m in self.groups[owner[layer]].members:
                full = f"layer.{layer}" + (f".{m.name}" if m.name else "")
                out.append((full, m.page_bytes(self.block_tokens, self.tp_size), m.replicated))
        object.__setattr__(self, "members", tuple(out))

    # -- derived ----------------------------------------------------------------------------
    @property
    def stage_layers(self) -> range:
        """The layers this pipeline stage holds: contiguous, earlier stages take the remainder."""
        per, extra = divmod(self.num_layers, self.pp_size)
        start = self.pp_rank * per + min(self.pp_rank, extra)
        return range(start, start + per + (1 if self.pp_rank < extra else 0))

    @property
    def packed(self) -> bool:
        return self.layout.startswith("BL")

    @property
    def row(self) -> int:
        """Bytes one block holds on this worker (every member's page)."""
        return sum(size for _, size, _ in self.members)

    @property
    def layers(self) -> int:
        return len(self.stage_layers)

    @property
    def page(self) -> int:
        """The page size when every member has the same one (else a :class:`SpecError`)."""
        sizes = {size for _, size, _ in self.members}
        if len(sizes) != 1:
            raise SpecError(f"{self.name}: members have different page sizes {sorted(sizes)}")
        return sizes.pop()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def member_names(self) -> list[tuple[str, int]]:
        return [(n, size) for n, size, _ in self.members]

    def offsets(self) -> dict[str, tuple[int, int]]:
        """``name -> (offset, size)`` of each member inside the logical row (row order)."""
        out, cursor = {}, 0
        for n, size, _ in self.members:
            out[n] = (cursor, size)
            cursor += size
        return out

    def replicated(self) -> Callable[[str], bool]:
        rep = {n: r for n, _, r in self.members}
        return lambda n: rep[n]

    # -- variants ---------------------------------------------------------------------------
    def with_layout(self, packed: bool | None) -> "Geometry":
        """The same geometry, one row per block (``packed``) or one region per member."""
        if packed is None or packed == self.packed:
            return self
        return dataclasses.replace(self, layout=("BL" if packed else "LB") + self.layout[2:])

    def with_parallel(self, tp: tuple[int, int] | None = None, pp: tuple[int, int] | None = None) -> "Geometry":
        """The same model on another rank: ``tp``/``pp`` are ``(rank, size)``."""
        g = self
        if tp is not None:
            g = dataclasses.replace(g, tp_rank=tp[0], tp_size=tp[1])
        if pp is not None:
            g = dataclasses.replace(g, pp_rank=pp[0], pp_size=pp[1])
        return g

    # -- specs and buffers ------------------------------------------------------------------
    def spec(self, num_blocks: int, *, packed: bool | None = None, base: int = FAKE_BASE) -> KVCacheSpec:
        """A planning spec at a fake address (``packed`` overrides the file's layout).

        Built by the discovery that registers an engine's tensors (:mod:`kvxfer.geometry._views`),
        so its pages carry dtype, axes and heads exactly as a registered cache of this
        geometry would: ``kvxfer plan`` and ``Agent.add_peer`` then reach one verdict.
        """

        return geometry_spec(self.with_layout(packed), num_blocks, base)

    def spec_for(self, views: Mapping[str, Any], *, packed: bool | None = None) -> KVCacheSpec:
        """The spec of real host buffers laid out by this geometry (see ``kvxfer.testing.buffers``)."""
        g = self.with_layout(packed)
        return spec_from_arrays(views, replicated=g.replicated(), layout=g.layout, block_tokens=g.block_tokens,
                                tp_rank=g.tp_rank, tp_size=g.tp_size)

    def to_dict(self) -> dict[str, Any]:
        """The spec-file form (JSON types), as :func:`loads` reads it back."""
        return {
            "name": self.name, "description": self.description, "layers": self.num_layers,
            "block_tokens": self.block_tokens, "layout": self.layout,
            "parallel": {"tp_size": self.tp_size, "tp_rank": self.tp_rank, "pp_size": self.pp_size,
                         "pp_rank": self.pp_rank},
            "groups": [{"layers": _ranges(list(g.layers)), "members": [
                {"name": m.name, "dtype": m.dtype, "heads": m.heads, "shape": list(m.shape),
                 "per_token": m.per_token, "replicated": m.replicated} for m in g.members]} for g in self.groups],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<spec>") -> "Geometry":
        return _parse(d, source)


# -- parsing --------------------------------------------------------------------------------
_TOP = {"name", "description", "layers", "block_tokens", "layout", "parallel", "groups"}
_PARALLEL = {"tp_size", "tp_rank", "pp_size", "pp_rank"}
_MEMBER = {"name", "dtype", "heads", "head_dim", "shape", "per_token", "replicated"}
_GROUP = {"layers", "members"}


def load(path: str | os.PathLike[str]) -> Geometry:
    """Read a ``.toml`` or ``.json`` spec file."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise SpecFileError(f"{p}: cannot read: {exc.strerror or exc}") from None
    return loads(raw, source=p, fmt="json" if p.endswith(".json") else "toml")


def loads(text: str | bytes, *, source: str = "<spec>", fmt: str = "toml") -> Geometry:
    """Parse spec-file text (``fmt`` is ``"toml"`` or ``"json"``)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecFileError(f"{source}: not UTF-8 text") from None
    try:
        if fmt == "json":
            data = json.loads(text)
        else:
            data = _toml().loads(text)
    except ValueError as exc:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        raise SpecFileError(f"{source}: not valid {fmt.upper()}: {exc}") from None
    return _parse(data, source)


def _toml() -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise SpecFileError("TOML spec files need Python 3.11 or `pip install tomli`; JSON works "
                                "everywhere") from None
    return tomllib


def _parse(d: Any, source: str) -> Geometry:
    where = _Where(source)
    if not isinstance(d, Mapping):
        raise where.error("", "expected a table of keys")
    where.keys("", d, _TOP, required={"layers", "block_tokens", "groups"})
    par = d.get("parallel", {})
    if not isinstance(par, Mapping):
        raise where.error("parallel", "expected a table")
    where.keys("parallel", par, _PARALLEL)
    num_layers = where.integer("layers", d["layers"], 1, MAX_LAYERS)
    groups_raw = d["groups"]
    if not isinstance(groups_raw, list) or not groups_raw:
        raise where.error("groups", "expected a non-empty list of groups")
    groups = []
    for gi, g in enumerate(groups_raw):
        key = f"groups[{gi}]"
        if not isinstance(g, Mapping):
            raise where.error(key, "expected a table")
        where.keys(key, g, _GROUP, required={"layers", "members"})
        layers = () if g["layers"] == "rest" else _layers(where, f"{key}.layers", g["layers"], num_layers)
        ms = g["members"]
        if not isinstance(ms, list) or not ms:
            raise where.error(f"{key}.members", "expected a non-empty list of members")
        members = tuple(_member(where, f"{key}.members[{mi}]", m) for mi, m in enumerate(ms))
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise where.error(f"{key}.members", f"duplicate member names {sorted(names)}")
        groups.append(LayerGroup(layers, members))
    rest = [gi for gi, g in enumerate(groups_raw) if g["layers"] == "rest"]
    if len(rest) > 1:
        raise where.error(f"groups[{rest[1]}].layers", "only one group may take the 'rest' of the layers")
    if rest:
        taken = {layer for g in groups for layer in g.layers}
        left = tuple(i for i in range(num_layers) if i not in taken)
        if not left:
            raise where.error(f"groups[{rest[0]}].layers", "'rest' selects no layer")
        groups[rest[0]] = LayerGroup(left, groups[rest[0]].members)
    try:
        return Geometry(
            name=where.string("name", d.get("name", os.path.splitext(os.path.basename(source))[0])),
            description=where.string("description", d.get("description", "")),
            num_layers=num_layers,
            block_tokens=where.integer("block_tokens", d["block_tokens"], 1, 1 << 24),
            groups=tuple(groups),
            layout=where.string("layout", d.get("layout", "BLHNC")),
            tp_rank=where.integer("parallel.tp_rank", par.get("tp_rank", 0), 0, 1 << 16),
            tp_size=where.integer("parallel.tp_size", par.get("tp_size", 1), 1, 1 << 16),
            pp_rank=where.integer("parallel.pp_rank", par.get("pp_rank", 0), 0, MAX_LAYERS),
            pp_size=where.integer("parallel.pp_size", par.get("pp_size", 1), 1, MAX_LAYERS),
        )
    except SpecFileError:
        raise
    except SpecError as exc:
        raise SpecFileError(f"{source}: {exc}") from None


def _member(where: "_Where", key: str, m: Any) -> MemberKind:
    if not isinstance(m, Mapping):
        raise where.error(key, "expected a table")
    where.keys(key, m, _MEMBER, required={"dtype"})
    if ("head_dim" in m) == ("shape" in m):
        raise where.error(key, "give exactly one of head_dim or shape")
    if "head_dim" in m:
        shape: tuple[int, ...] = (where.integer(f"{key}.head_dim", m["head_dim"], 1, 1 << 24),)
    else:
        raw = m["shape"]
        if not isinstance(raw, list) or not 1 <= len(raw) <= 8:
            raise where.error(f"{key}.shape", "expected a list of 1 to 8 positive integers")
        shape = tuple(where.integer(f"{key}.shape[{i}]", v, 1, 1 << 24) for i, v in enumerate(raw))
    dtype = where.string(f"{key}.dtype", m["dtype"])
    if dtype not in DTYPES:
        raise where.error(f"{key}.dtype", f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    name = where.string(f"{key}.name", m.get("name", ""))
    if name and (len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name)):
        raise where.error(f"{key}.name", f"{name!r}: use letters, digits, '_' or '-' (at most 64)")
    return MemberKind(name, dtype, shape, where.integer(f"{key}.heads", m.get("heads", 1), 1, 1 << 16),
                      where.boolean(f"{key}.per_token", m.get("per_token", True)),
                      where.boolean(f"{key}.replicated", m.get("replicated", False)))


def _layers(where: "_Where", key: str, v: Any, num_layers: int) -> tuple[int, ...]:
    """``"all"``, ``"0-60"``, ``"3-47/4"``, ``"0-2,5"`` or a list of integers (``"rest"`` is resolved later)."""
    if isinstance(v, list):
        out = [where.integer(f"{key}[{i}]", x, 0, num_layers - 1) for i, x in enumerate(v)]
    elif isinstance(v, str):
        out = []
        for part in v.replace(" ", "").split(","):
            if part == "all":
                out.extend(range(num_layers))
                continue
            rng, _, step = part.partition("/")
            lo, dash, hi = rng.partition("-")
            try:
                a = int(lo)
                b = int(hi) if dash else a
                s = int(step) if step else 1
            except ValueError:
                raise where.error(key, f"cannot read {part!r}; write 'all', '0-60', '3-47/4' or '0-2,5'") from None
            if not 0 <= a <= b < num_layers or s < 1:
                raise where.error(key, f"{part!r} is outside layers 0..{num_layers - 1}")
            out.extend(range(a, b + 1, s))
    else:
        raise where.error(key, "expected a string such as '0-60' or a list of layer numbers")
    if len(set(out)) != len(out):
        raise where.error(key, "a layer is listed twice")
    if not out:
        raise where.error(key, "selects no layer")
    return tuple(out)


class _Where:
    """Error messages that say which file and which key."""

    def __init__(self, source: str):
        self.source = source

    def error(self, key: str, msg: str) -> SpecFileError:
        return SpecFileError(f"{self.source}: {key + ': ' if key else ''}{msg}")

    def keys(self, key: str, d: Mapping[str, Any], allowed: set[str], required: Collection[str] = ()) -> None:
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise self.error(key, f"unknown key(s) {', '.join(map(repr, unknown))}; "
                                  f"allowed: {', '.join(sorted(allowed))}")
        missing = sorted(set(required) - set(d))
        if missing:
            raise self.error(key, f"missing key(s) {', '.join(map(repr, missing))}")

    def integer(self, key: str, v: Any, lo: int, hi: int) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise self.error(key, f"expected an integer in [{lo}, {hi}], got {v!r}")
        return v

    def string(self, key: str, v: Any) -> str:
        if not isinstance(v, str) or len(v) > 4096:
            raise self.error(key, f"expected a string, got {type(v).__name__}")
        return v

    def boolean(self, key: str, v: Any) -> bool:
        if not isinstance(v, bool):
            raise self.error(key, f"expected true or false, got {v!r}")
        return v


def _ranges(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    xs = sorted(layers)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(f"{xs[i]}-{xs[j]}" if j > i else str(xs[i]))
        i = j + 1
    return ",".join(out)

