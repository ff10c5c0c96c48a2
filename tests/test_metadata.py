"""Agent metadata: a round trip, and untrusted bytes that may only ever raise MetadataError."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from docpaths import leaves, replaced

from kvxfer import AgentMetadata, Allocation, KVCacheSpec, Member, MetadataError, PackedLayout, Region
from kvxfer.metadata import MAGIC, MAX_METADATA_BYTES, PROTOCOL_VERSION

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_spec() -> KVCacheSpec:
    allocs = (Allocation(1 << 40, 64 * 1024), Allocation(1 << 41, 64 * 512, "VRAM", 3))
    regions = (Region(0, 0, 64, PackedLayout(1024, tuple(Member(f"layer.{i}", 200, i * 200, True) for i in range(5)))),
               Region(1, 0, 64, PackedLayout(512, (Member("indexer", 500, 0, False),))))
    return KVCacheSpec(allocs, regions, layout="BLHNC", block_tokens=64, tp_rank=1, tp_size=4)


def make_meta(**kw) -> AgentMetadata:
    fields = dict(name="decode-0@host:5555", generation=123456789, backend="nixl",
                  blob=bytes(range(256)) * 3, spec=make_spec())
    fields.update(kw)
    return AgentMetadata(**fields)  # type: ignore[arg-type]


def doc_of(meta: AgentMetadata) -> dict:
    raw = meta.encode()
    assert raw.startswith(MAGIC)
    return json.loads(raw[len(MAGIC):])


def encode_doc(doc: object) -> bytes:
    return MAGIC + json.dumps(doc).encode()


def test_round_trip() -> None:
    m = make_meta()
    back = AgentMetadata.decode(m.encode())
    assert back == m and back.spec == m.spec and back.blob == m.blob
    assert back.spec is not None and back.spec.to_dict() == m.spec.to_dict()  # type: ignore[union-attr]
    assert AgentMetadata.decode(bytearray(m.encode())) == m
    assert AgentMetadata.decode(memoryview(m.encode())) == m
    none = make_meta(spec=None, blob=b"")
    assert AgentMetadata.decode(none.encode()) == none


def test_encoding_is_json_not_pickle() -> None:
    doc = doc_of(make_meta())
    assert doc["version"] == PROTOCOL_VERSION and base64.b64decode(doc["blob"]) == bytes(range(256)) * 3


@pytest.mark.parametrize("kw", [dict(name=""), dict(name="a b"), dict(name="x\n"), dict(name="é"),
                                dict(name="x" * 129), dict(generation=0), dict(generation=True),
                                dict(generation=1 << 63), dict(generation=1.0), dict(backend="nixl\n"),
                                dict(blob="text"), dict(spec={"layout": "BLHNC"}), dict(version=True)])
def test_constructor_validates(kw) -> None:
    with pytest.raises(MetadataError):
        make_meta(**kw)


def test_oversized_input_is_rejected_before_parsing() -> None:
    with pytest.raises(MetadataError, match="limit"):
        AgentMetadata.decode(MAGIC + b" " * MAX_METADATA_BYTES)
    with pytest.raises(MetadataError, match="limit"):
        make_meta(blob=b"\0" * MAX_METADATA_BYTES).encode()


@pytest.mark.parametrize("raw", [b"", b"KVXF", MAGIC, MAGIC + b"{", MAGIC + b"[]", MAGIC + b"null",
                                 MAGIC + b"\xff\xfe", MAGIC + b"NaN", MAGIC + b"[" * 100_000, b"{}",
                                 MAGIC + b'{"version": 1}'])
def test_garbage(raw: bytes) -> None:
    with pytest.raises(MetadataError):
        AgentMetadata.decode(raw)


def test_non_bytes() -> None:
    for x in ("str", None, 5, [1]):
        with pytest.raises(MetadataError):
            AgentMetadata.decode(x)  # type: ignore[arg-type]


@pytest.mark.parametrize("field,value", [
    ("version", True), ("version", 2.0), ("version", "2"), ("version", 1), ("version", 3), ("version", None),
    ("generation", True), ("generation", -1), ("generation", 0), ("generation", 1 << 64), ("generation", 1.5),
    ("generation", "7"), ("name", 1), ("name", None), ("backend", ["nixl"]), ("blob", "not base64!"),
    ("blob", 5), ("blob", None), ("spec", 5), ("spec", []), ("spec", "x"),
])
def test_bad_fields(field: str, value: object) -> None:
    doc = doc_of(make_meta())
    doc[field] = value
    with pytest.raises(MetadataError):
        AgentMetadata.decode(encode_doc(doc))


def test_missing_and_extra_fields() -> None:
    doc = doc_of(make_meta())
    for k in list(doc):
        bad = dict(doc)
        del bad[k]
        with pytest.raises(MetadataError):
            AgentMetadata.decode(encode_doc(bad))
    with pytest.raises(MetadataError):
        AgentMetadata.decode(encode_doc({**doc, "extra": 1}))


def _decode_or_metadata_error(raw: bytes) -> None:
    """The contract: a valid AgentMetadata, or MetadataError; any other exception fails."""
    try:
        m = AgentMetadata.decode(raw)
    except MetadataError:
        return
    assert isinstance(m, AgentMetadata)
    assert AgentMetadata.decode(m.encode()) == m  # what was accepted encodes again


junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 80), 1 << 80) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.sampled_from([0, -1, 1, True, False, 1 << 63, 1 << 64, "DRAM", "VRAM", ""]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=16,
)


@FUZZ
@given(raw=st.binary(max_size=512))
def test_fuzz_random_bytes(raw: bytes) -> None:
    _decode_or_metadata_error(raw)
    _decode_or_metadata_error(MAGIC + raw)


@FUZZ
@given(cut=st.integers(0, 10_000))
def test_fuzz_truncations(cut: int) -> None:
    raw = make_meta().encode()
    _decode_or_metadata_error(raw[: cut % len(raw)])


@FUZZ
@given(pos=st.integers(0, 100_000), byte=st.integers(0, 255))
def test_fuzz_byte_flips(pos: int, byte: int) -> None:
    raw = bytearray(make_meta().encode())
    raw[pos % len(raw)] = byte
    _decode_or_metadata_error(bytes(raw))


@FUZZ
@given(which=st.integers(0, 100_000), value=junk)
def test_fuzz_mutated_json_fields(which: int, value: object) -> None:
    """Replace any one node (a field, a list item, a whole sub-object) of the document."""
    doc = doc_of(make_meta())
    paths = [p for p, _ in leaves(doc)]
    _decode_or_metadata_error(encode_doc(replaced(doc, paths[which % len(paths)], value)))


@FUZZ
@given(which=st.integers(0, 100_000), delta=st.sampled_from([-1, 1, 1 << 40, -(1 << 70), 1 << 64]))
def test_fuzz_numbers_shifted(which: int, delta: int) -> None:
    """Every integer in the document nudged: off-by-one offsets, huge and negative values."""
    doc = doc_of(make_meta())
    ints = [p for p in [p for p, _ in leaves(doc)] if isinstance(_get(doc, p), int) and not isinstance(_get(doc, p), bool)]
    p = ints[which % len(ints)]
    _decode_or_metadata_error(encode_doc(replaced(doc, p, _get(doc, p) + delta)))


def _get(d: object, path: tuple) -> object:
    for k in path:
        d = d[k]  # type: ignore[index]
    return d


def test_every_int_as_a_bool_is_rejected() -> None:
    doc = doc_of(make_meta())
    for p in [p for p, _ in leaves(doc)]:
        v = _get(doc, p)
        if isinstance(v, int) and not isinstance(v, bool) and v in (0, 1):
            with pytest.raises(MetadataError):
                AgentMetadata.decode(encode_doc(replaced(doc, p, bool(v))))


@pytest.mark.parametrize("depth", [50, 900, 5000])
def test_deeply_nested_junk_in_spec(depth: int) -> None:
    doc = doc_of(make_meta())
    doc["spec"]["regions"][0]["layout"]["members"] = "HOLE"
    text = json.dumps(doc).replace('"HOLE"', "[" * depth + "1" + "]" * depth)
    with pytest.raises(MetadataError):
        AgentMetadata.decode(MAGIC + text.encode())
