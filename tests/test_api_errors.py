"""Wrong input to the public API is a typed :class:`KvxferError` with a short, useful message.

Unknown backend options name the valid ones (checked once, in the core, for every backend);
metadata passed where a peer name belongs gives a hint instead of the whole blob; block ids
that are not integers and arguments of the wrong type have errors of their own. Each refusal
has a control: the same call with the right argument goes through.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np
import pytest

import kvxfer
from kvxfer import Backend, KvxferError
from kvxfer.errors import (BackendUnavailableError, BlockIdTypeError, InvalidArgumentError, UnknownOptionError,
                           UnknownPeerError)
from kvxfer.plugin.backend import check_options


@pytest.fixture
def pair() -> Any:
    prefill, decode = kvxfer.Agent("prefill"), kvxfer.Agent("decode")
    src, dst = np.arange(8 * 64, dtype=np.uint8).reshape(8, 64), np.full((8, 64), 0xAA, np.uint8)
    prefill.register({"kv": src})
    decode.register({"kv": dst})
    peer = decode.add_peer(prefill.metadata())
    yield prefill, decode, peer, src, dst
    decode.close()
    prefill.close()


class _Opts(Backend):
    """A backend with one option, to check the core's option check on its own."""

    def __init__(self, agent_name: str, *, speed: int = 1) -> None:
        super().__init__(agent_name)


class _Forwards(Backend):
    """A backend that passes whatever it is given on to :class:`Backend`, as tinycopy does."""

    def __init__(self, agent_name: str, **options: Any) -> None:
        super().__init__(agent_name, **options)


def test_check_options_names_the_valid_ones() -> None:
    check_options(_Opts, {"speed": 2})  # control: a real option passes
    with pytest.raises(UnknownOptionError, match=r"no option 'sped'; its options: speed") as ei:
        check_options(_Opts, {"sped": 2})
    assert ei.value.valid == ("speed",) and isinstance(ei.value, TypeError)
    # **options: the backend is trusted to check, or to pass them on to Backend.__init__,
    # which refuses them (loopback and tinycopy do that: the test below).
    check_options(_Forwards, {"anything": 1})


@pytest.mark.parametrize("backend", ["loopback", "nixl", "ucx"])
def test_unknown_backend_option_is_typed_on_every_backend(backend: str) -> None:
    try:
        kvxfer.plugin.registry.get_backend_class(backend)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    with pytest.raises(UnknownOptionError) as ei:
        kvxfer.Agent("a", backend=backend, progres_thread=True)
    assert "'progres_thread'" in str(ei.value)
    if backend == "nixl":
        assert "progress_thread" in ei.value.valid
    if backend == "loopback":
        assert "its options: none" in str(ei.value)


def test_metadata_passed_as_a_peer_name_gives_a_short_hint(pair: Any) -> None:
    prefill, decode, peer, _, dst = pair
    blob = prefill.metadata()
    with pytest.raises(UnknownPeerError) as ei:
        decode.read(blob, [0], [1])
    msg = str(ei.value)
    assert len(msg) < 300 and blob.decode("latin-1")[:40] not in msg
    assert "add_peer" in msg and f"{len(blob)} bytes" in msg
    with pytest.raises(UnknownPeerError, match=r"\.\.\. \(1000 characters\)"):
        decode.read("x" * 1000, [0], [1])  # a long string is cut too
    decode.read(peer, [0], [1]).wait(timeout=10)  # control: the name works
    assert (dst[0] == np.arange(64, 128)).all()


@pytest.mark.parametrize("ids", [[1.0], np.array([0.5]), [True], ["1"], "1", [[0], [1, 2]]])
def test_block_ids_that_are_not_integers(pair: Any, ids: Any) -> None:
    _, decode, peer, _, dst = pair
    n = len(ids)
    with pytest.raises(BlockIdTypeError):
        decode.read(peer, ids, list(range(n)))
    with pytest.raises(BlockIdTypeError):
        decode.read(peer, list(range(n)), ids)
    assert (dst == 0xAA).all()  # nothing moved


def test_wrong_argument_types(pair: Any) -> None:
    prefill, decode, peer, src, dst = pair
    with pytest.raises(InvalidArgumentError, match="notify must be bytes"):
        decode.read(peer, [0], [1], notify="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="op must be"):
        decode.plan(peer, [0], [1], op="COPY")
    with pytest.raises(InvalidArgumentError, match="op must be"):
        kvxfer.plan(decode.spec, prefill.spec, [0], [1], "COPY")
    assert decode.plan(peer, [0], [1], op="write").descriptors == 1  # controls
    decode.read(peer, [2], [3], notify=b"x").wait(timeout=10)
    assert (dst[2] == src[3]).all() and (dst[3] == 0xAA).all()


BAD = [None, 1.5, -1, "x", b"x", object(), [None], {"a": 1}, float("nan")]


def _calls(decode: kvxfer.Agent, peer: str) -> dict[str, Callable[[Any], Any]]:
    return {
        "read.peer": lambda v: decode.read(v, [0], [1]),
        "read.local": lambda v: decode.read(peer, v, [1]),
        "read.remote": lambda v: decode.read(peer, [0], v),
        "read.notify": lambda v: decode.read(peer, [0], [1], notify=v),
        "write.notify": lambda v: decode.write(peer, [0], [1], notify=v),
        "plan.op": lambda v: decode.plan(peer, [0], [1], op=v),
        "add_peer": lambda v: decode.add_peer(v),
        "add_source": lambda v: decode.add_source(v),
        "check": lambda v: decode.check(v),
        "remove_peer": lambda v: decode.remove_peer(v),
        "notify.peer": lambda v: decode.notify(v, b"m"),
        "notify.message": lambda v: decode.notify(peer, v),
        "read_many": lambda v: decode.read_many([0], v),
        "register": lambda v: kvxfer.Agent("r").register(v),
        "agent.timeout": lambda v: kvxfer.Agent("t", timeout=v),
        "agent.name": lambda v: kvxfer.Agent(v),
        "agent.backend": lambda v: kvxfer.Agent("b", backend=v),
        "wait.timeout": lambda v: decode.read(peer, [4], [5]).wait(timeout=v),
    }


def test_only_kvxfer_errors_leave_the_public_api(pair: Any) -> None:
    """Every public call fed every wrong value either works or raises a KvxferError."""
    _, decode, peer, _, _ = pair
    leaks = []
    for (what, call), value in itertools.product(_calls(decode, peer).items(), BAD):
        try:
            result = call(value)
        except KvxferError:
            continue
        except Exception as exc:  # noqa: BLE001 - the point of the test
            leaks.append(f"{what}({value!r}): {type(exc).__name__}: {exc}")
        else:
            if isinstance(result, kvxfer.Transfer):
                result.wait(timeout=10)
    assert not leaks, "\n".join(leaks)


@pytest.mark.parametrize("ids", [[0, True], [np.True_, 5], (np.bool_(False), 2)])
def test_a_bool_among_integer_block_ids_is_refused(pair: Any, ids: Any) -> None:
    _, decode, peer, _, dst = pair
    with pytest.raises(BlockIdTypeError, match="bool"):
        decode.read(peer, ids, [3, 4])
    with pytest.raises(BlockIdTypeError, match="bool"):
        decode.read(peer, [3, 4], ids)
    assert (dst == 0xAA).all()


def test_control_numpy_turns_a_mixed_bool_into_block_one(pair: Any) -> None:
    """Why the check looks before converting: the converted list is plain integers, True is 1."""
    _, decode, peer, src, dst = pair
    converted = np.asarray([0, True])
    assert converted.dtype.kind == "i"
    decode.read(peer, [3, 4], converted).wait(timeout=10)
    assert (dst[4] == src[1]).all() and (dst[3] == src[0]).all()


def test_register_refuses_unknown_options_and_wrong_types() -> None:
    kv = {"kv": np.zeros((8, 64), np.uint8)}
    with kvxfer.Agent("r") as a:
        with pytest.raises(UnknownOptionError, match="no option 'unknown_option'") as ei:
            a.register(kv, unknown_option=1)
        assert "kv_heads" in ei.value.valid
        for bad in ({"kv_heads": "8"}, {"kv_heads": 0}, {"block_tokens": 1.5}, {"layout": 5}, {"dims": 5},
                    {"replicated": 5}, {"replicated": "kv"}, {"replicated": [1]}, {"tp_size": "2"},
                    {"tp_rank": -1}, {"kv_dim": True}):
            with pytest.raises(KvxferError):
                a.register(kv, **bad)
            assert a.spec is None
        assert a.register(kv, tp_size=1, replicated={"kv"}).members[0].replicated  # control


def test_register_of_too_many_arrays_is_refused_before_walking_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvxfer.geometry._discover as discover
    from kvxfer.errors import SpecError
    from kvxfer.geometry._spec import MAX_ALLOCATIONS, MAX_MEMBERS

    seen = []
    real = discover._describe
    monkeypatch.setattr(discover, "_describe", lambda n, x: seen.append(n) or real(n, x))
    one = np.zeros((4, 16), np.uint8)
    with kvxfer.Agent("r") as a:
        with pytest.raises(SpecError, match="entries"):
            a.register(dict.fromkeys((f"l{i}" for i in range(MAX_MEMBERS + 1)), one))
        assert seen == []  # counted, not walked
        with pytest.raises(SpecError, match="separate storages"):
            a.register({f"l{i}": np.zeros((4, 16), np.uint8) for i in range(5000)})
        assert len(seen) == MAX_ALLOCATIONS + 1  # stopped at the first storage past the bound
        seen.clear()
        assert len(a.register({f"l{i}": np.zeros((4, 16), np.uint8) for i in range(400)}).allocations) == 400


def test_store_arguments_are_typed(tmp_path: Any) -> None:
    from kvxfer.errors import StoreError

    kv = np.arange(4 * 4096, dtype=np.uint32).astype(np.uint8).reshape(4, 4096)
    back = np.full_like(kv, 0xAA)
    with kvxfer.Agent("s") as a:
        spec = a.register({"kv": kv})
        file = tmp_path / "file"
        file.write_bytes(b"x")
        for path in ("", "a\0b", str(file), b"", 5, None):
            with pytest.raises(KvxferError):
                kvxfer.Store(path, capacity=1 << 16, layout=spec)
        with kvxfer.Store(tmp_path / "s", capacity=1 << 16, layout=spec) as store:
            for keys in (b"key", "key", None, 5, [None], [b""]):
                for call in (store.lookup, store.prefix, store.discard,
                             lambda k: store.offload(a, [0], k), lambda k: store.restore(k, a, [0]),
                             lambda k: a.offload(store, [0], k), lambda k: a.restore(store, k, [0])):
                    with pytest.raises(KvxferError):
                        call(keys)
            for not_a_store in (None, "store", object(), tmp_path):
                with pytest.raises(InvalidArgumentError):
                    a.offload(not_a_store, [0], [b"k"])
                with pytest.raises(InvalidArgumentError):
                    a.restore(not_a_store, [b"k"], [0])
            with pytest.raises(InvalidArgumentError):
                store.offload(object(), [0], [b"k"])
            with pytest.raises(StoreError):
                store.restore([b"never stored"], a, [0]).wait(10)
            # Control: the right arguments move the right bytes.
            a.offload(store, [1, 3], [b"k1", b"k3"]).wait(10)
            a.deregister()
            a.register({"kv": back})
            a.restore(store, [b"k3"], [0]).wait(10)
            assert (back[0] == kv[3]).all() and (back[1:] == 0xAA).all()
