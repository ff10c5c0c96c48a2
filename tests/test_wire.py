"""The wire toolkit (kvxfer/_wire.py) and the one HMAC (kvxfer/tokens.py): fuzzed once, with controls.

Every reader of peers' bytes goes through these functions, so the fuzz here is the one that
says "nothing but a typed error escapes". Each test's control runs the same input through
what the toolkit replaced (a bare ``struct``/``json`` read, a looser rule) and shows the bad
outcome it would have let through.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import struct
from pathlib import Path

import pytest

from kvxfer import _wire
from kvxfer.errors import KvxferError, MetadataError, SpecError
from kvxfer.tokens import LABELS, MIN_CLUSTER_TOKEN, check_token, mac, verify

ROOT = Path(__file__).resolve().parents[1]
_LEN = struct.Struct("<Q")


def _record(tag: bytes, payload: bytes) -> bytes:
    return tag + _LEN.pack(len(payload)) + payload + b"|"


def _read_all(raw: bytes) -> list[bytes]:
    r = _wire.Reader(raw, "fuzz records")
    r.expect(b"HEAD")
    n = _LEN.unpack(r.field(b"n", 8, end=b"|", exact=8))[0]
    out = [r.field(b"v", 64, end=b"|") for _ in range(min(n, 8))]
    r.done()
    return out


def _naive(raw: bytes) -> list[bytes]:
    """The control: the same format read with bare struct calls, as hand-written readers did."""
    n = _LEN.unpack_from(raw, 13)[0]  # after "HEAD", "n" and its length
    pos, out = 22, []
    for _ in range(min(n, 8)):
        (m,) = _LEN.unpack_from(raw, pos + 1)
        out.append(raw[pos + 9:pos + 9 + m])
        pos += 10 + m
    return out


def _mutants(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    good = b"HEAD" + _record(b"n", _LEN.pack(3)) + b"".join(_record(b"v", bytes([i]) * 5) for i in range(3))
    out = []
    for _ in range(count):
        raw = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(3)
            if op == 0 and raw:
                del raw[rng.randrange(len(raw)):]
            elif op == 1 and raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            else:
                raw[rng.randrange(len(raw) + 1):0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        out.append(bytes(raw))
    return out


def test_reader_fuzz_only_typed_errors() -> None:
    """2,000 mutants of a record stream: each parses or raises MetadataError, nothing else."""
    good = b"HEAD" + _record(b"n", _LEN.pack(3)) + b"".join(_record(b"v", bytes([i]) * 5) for i in range(3))
    assert _read_all(good) == [bytes([i]) * 5 for i in range(3)]
    refused = 0
    for raw in _mutants(1, 2000):
        try:
            _read_all(raw)
        except MetadataError as exc:
            refused += 1
            assert "fuzz records is malformed at byte" in str(exc)
    assert refused > 1500


def test_reader_fuzz_control_bare_struct_escapes() -> None:
    """Control: the bare reader lets struct.error and OverflowError out, or returns short or trailing-garbage reads."""
    good = b"HEAD" + _record(b"n", _LEN.pack(3)) + b"".join(_record(b"v", bytes([i]) * 5) for i in range(3))
    assert _naive(good) == _read_all(good)  # a faithful reader of the good stream
    escaped = silent = 0
    for raw in _mutants(1, 2000):
        try:
            got = _naive(raw)
        except (struct.error, OverflowError):  # untyped: a caller catching MetadataError crashes
            escaped += 1
            continue
        try:
            _read_all(raw)
        except MetadataError:
            silent += got != []  # the bare reader accepted what the toolkit refuses
    assert escaped > 100 and silent > 100


def test_reader_bounds_before_reading() -> None:
    r = _wire.Reader(b"t" + _LEN.pack(1 << 60) + b"x|", "hostile")
    with pytest.raises(MetadataError, match="bad length"):
        r.field(b"t", 1 << 20, end=b"|")
    r = _wire.Reader(b"abc", "short", SpecError)
    with pytest.raises(SpecError, match="4 bytes wanted, 3 left"):
        r.take(4)


_JSON_SEEDS = [b'{"a":1,"b":"x"}', b'[1,2,{"c":null}]', b'{"n":1.5e3}']


def test_load_json_fuzz_only_typed_errors() -> None:
    rng = random.Random(2)
    tokens = [b"NaN", b"Infinity", b'"\\ud800"', b'"a":1,"a":2', b"[" * 5000, b"\xff", b"\x00", b"1e999999"]
    for i in range(1500):
        raw = bytearray(_JSON_SEEDS[i % len(_JSON_SEEDS)])
        at = rng.randrange(len(raw) + 1)
        raw[at:at + rng.randint(0, 2)] = rng.choice(tokens) if rng.random() < 0.5 else bytes([rng.randrange(256)])
        try:
            _wire.load_json(bytes(raw), "fuzz json", limit=1 << 16)
        except MetadataError:
            pass


@pytest.mark.parametrize("raw, why", [
    (b'{"a":NaN}', "NaN"), (b'{"a":1,"a":2}', "duplicate"), (b'{"s":"\\ud800"}', "surrogate"),
    (b"\xff{}", "not UTF-8"), (b"[" * 100000, "deep"),
])
def test_load_json_refuses(raw: bytes, why: str) -> None:
    with pytest.raises(MetadataError):
        _wire.load_json(raw, why, limit=1 << 20)


def test_load_json_control_plain_json_accepts_or_escapes() -> None:
    """Control: the standard parser accepts NaN and duplicate keys, keeps a lone surrogate and
    raises untyped errors: what every hand-written reader had to remember to refuse."""
    assert json.loads(b'{"a":1,"a":2}') == {"a": 2}
    assert json.loads(b'{"a":NaN}')["a"] != json.loads(b'{"a":NaN}')["a"]
    with pytest.raises(UnicodeEncodeError):
        json.loads(b'{"s":"\\ud800"}')["s"].encode("utf-8")
    with pytest.raises(RecursionError):
        json.loads(b"[" * 100000 + b"]" * 100000)


def test_load_json_bounds_before_parsing() -> None:
    with pytest.raises(MetadataError, match="over the 10 limit"):
        _wire.load_json(b"[" + b"1," * 100 + b"1]", "big", limit=10)
    with pytest.raises(MetadataError, match="JSON items"):
        _wire.load_json(b"[" + b"1," * 100 + b"1]", "many", limit=1 << 20, max_items=10)


@pytest.mark.parametrize("value, ok", [
    ("prefill0", True), ("h\u00e9te", True), ("x" * 8, True), ("x" * 9, False), ("\u00e9" * 5, False),
    ("", False), ("a\x00b", False), ("a\nb", False), ("a\u2028b", False), ("\ud800", False), (b"bytes", False),
    (7, False), (None, False),
])
def test_text_rule(value: object, ok: bool) -> None:
    """UTF-8, 1..limit bytes (not characters), printable: no NUL, newline or line separator."""
    if ok:
        assert _wire.text(value, "name", 8) == value
    else:
        with pytest.raises(MetadataError, match="printable UTF-8 string of 1..8 bytes"):
            _wire.text(value, "name", 8)


def test_text_rule_control_old_rules_disagreed() -> None:
    """Control: the two rules the toolkit replaced each let through what the other refused."""
    def utf8_bytes(v: str, limit: int) -> bool:  # the UCX blob's old _text
        try:
            return 0 < len(v.encode("utf-8")) <= limit
        except UnicodeEncodeError:
            return False

    def printable_chars(v: str, limit: int) -> bool:  # the vLLM params' old _text
        return 0 < len(v) <= limit and v.isprintable()

    assert utf8_bytes("a\x00b", 8)  # NUL accepted: a C string ends there
    assert printable_chars("\u00e9" * 5, 8)  # 10 bytes under an 8 "limit"
    for v in ("a\x00b", "\u00e9" * 5):
        with pytest.raises(MetadataError):
            _wire.text(v, "name", 8)


def test_integer_rule() -> None:
    import numpy as np

    assert _wire.integer(5, "n", 0, 9) == 5
    for bad in (True, False, 1.0, "1", None, np.int64(5)):
        with pytest.raises(MetadataError):
            _wire.integer(bad, "n", 0, 9)
    assert type(_wire.integer(np.int64(5), "n", 0, 9, integral=True)) is int
    with pytest.raises(SpecError, match=r"n=10 is outside \[0, 9\]"):
        _wire.integer(10, "n", 0, 9, SpecError)
    with pytest.raises(MetadataError):
        _wire.integer(np.bool_(True), "n", 0, 9, integral=True)
    assert isinstance(True, int) and 0 <= True <= 9  # control: a bare isinstance/range check takes True


def test_b64_bounded() -> None:
    assert _wire.b64("AAEC", "k", 3) == b"\0\1\2"
    for bad in ("AAECAw==", "!!!!", "", "AAE\u00e9"):
        with pytest.raises(MetadataError):
            _wire.b64(bad, "k", 3)


# -- the one HMAC ---------------------------------------------------------------------------
_K = b"k" * 16
_C, _S = b"c" * 32, b"s" * 32


def test_tags_are_the_old_wire_bytes() -> None:
    """Moving every HMAC into tokens.mac changed no byte: digests of tags made before the move."""
    from kvxfer.directory.codec import encode_value
    from kvxfer.metadata import seal
    from kvxfer.sidechannel import auth

    assert hashlib.sha256(seal(b"KVXFMETA{}", _K)).hexdigest() == \
        "9a5243832c59f37a0cfa507e627deb98a169826975596795c281401d96084a69"
    assert hashlib.sha256(encode_value("a/b", b"KVXFMETA{}", _K)).hexdigest() == \
        "b0cd0bd88066039acbbf7e524057a3106e7e760e8e9b62ff3bd3ac02ede74615"
    side = (auth.server_proof(_K, _C, _S) + auth.client_proof(_K, _C, _S) + auth.data_tag(_K, 3, _C, _S, b"x")
            + auth.reply_tag(_K, _C, _S, b"y"))
    assert hashlib.sha256(side).hexdigest() == "0af934fa86d76997a83672fd349ef1daf4213933679096acbfdebd081cf1a260"
    # kvxfer.integrations.vllm.params._signature([3, "e"], _K), which needs vLLM to import
    assert mac(_K, "vllm-params", b'[3,"e"]').hex() == \
        "02f1fa14e1bdfadf510371ade33768a9aa34441e69f91b721e4086e198693934"


def test_labels_separate_domains() -> None:
    from kvxfer.sidechannel.frames import VERSION

    assert len(set(LABELS.values())) == len(LABELS)
    assert all(v.endswith(bytes([VERSION])) for k, v in LABELS.items() if k.startswith("side-"))
    tag = mac(_K, "metadata", b"payload")
    assert verify(tag, _K, "metadata", b"payload")
    assert not any(verify(tag, _K, other, b"payload") for other in LABELS if other != "metadata")
    assert not verify(tag, b"K" * 16, "metadata", b"payload")  # control: another key


def test_cluster_token_rule() -> None:
    assert check_token(None) is None
    assert check_token("x" * MIN_CLUSTER_TOKEN) == b"x" * MIN_CLUSTER_TOKEN
    for bad in ("x" * (MIN_CLUSTER_TOKEN - 1), b"", "\ud800" * 16, 12345):
        with pytest.raises(MetadataError):
            check_token(bad)
    with pytest.raises(KvxferError, match="at least 16 bytes"):
        from kvxfer.directory.codec import check_token as directory_token
        directory_token("short")


# -- one home each (grep tests) -------------------------------------------------------------
def _sources() -> list[Path]:
    return [p for d in ("kvxfer", "plugins", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]


def _hits(pattern: str, files: list[Path]) -> set[str]:
    rx = re.compile(pattern, re.M)
    return {p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else p.name
            for p in files if rx.search(p.read_text(encoding="utf-8"))}


_HMAC = r"hmac\.new\(|hashlib\.\w*hmac|hmac\.HMAC\(|hmac\.digest\("
_HELPERS = r"^\s*def _(text|int|uint|str)\("


def test_one_hmac() -> None:
    assert _hits(_HMAC, _sources()) == {"kvxfer/tokens.py"}


def test_no_private_text_or_int_readers() -> None:
    """Text and integer rules live in kvxfer/_wire.py (``text``, ``integer``) and nowhere else."""
    assert _hits(_HELPERS, _sources()) == set()
    assert re.search(r"^def text\(", (ROOT / "kvxfer/_wire.py").read_text(), re.M)


def test_grep_control(tmp_path: Path) -> None:
    """Control: the two patterns find a planted second HMAC and a planted private reader."""
    bad = tmp_path / "bad.py"
    bad.write_text("import hashlib, hmac\nx = hmac.new(b'k', b'm', hashlib.sha256)\n\n    def _int(v):\n        return v\n")
    assert _hits(_HMAC, [bad]) == _hits(_HELPERS, [bad]) == {"bad.py"}


# -- the formats on the toolkit -------------------------------------------------------------
def test_metadata_refuses_duplicate_keys() -> None:
    """Two parsers of one document may keep different copies of a key: a peer could show one
    name to a logger and another to the pairing. Control: the plain parser keeps the last."""
    from kvxfer.metadata import MAGIC, AgentMetadata

    good = AgentMetadata("p", 1, "loopback", b"", None).encode()
    doc = good[len(MAGIC):].replace(b'"name":"p"', b'"name":"p","name":"q"')
    assert json.loads(doc)["name"] == "q"
    with pytest.raises(MetadataError, match="duplicate keys"):
        AgentMetadata.decode(MAGIC + doc)
    assert AgentMetadata.decode(good).name == "p"


def test_ucx_blob_refuses_a_nul_in_a_name() -> None:
    """The UCX blob's names are printable now (they reach logs and, the hostname, libc).
    Control: the same blob with a printable name parses."""
    from kvxfer_ucx._blob import encode_blob, parse_blob

    for agent, ok in (("p\x00q", False), ("p\nq", False), ("pq", True)):
        blob = encode_blob(agent, "1.21.0", b"\x01" * 8, [(4096, 64, b"k")], None)
        if ok:
            assert parse_blob(blob).agent == agent
        else:
            with pytest.raises(MetadataError, match="ucx metadata: agent must be a printable"):
                parse_blob(blob)
