"""The UCX backend's tests: skipped as a whole when libucp is not installed."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from kvxfer_ucx._libucp import find_libucp

if find_libucp() is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from kvxfer.testing.seam import joined
    from ucx_helpers import PATH_NAMES, PATHS, SENT, pattern  # noqa: E402
    from kvxfer_ucx.backend import UcxBackend

    Pair = tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]

    def _pair(opt: bool | None, nbytes: int, seed: int, **decode_options: Any) -> Iterator[Pair]:
        src = pattern(nbytes, seed)
        dst = np.full(nbytes, SENT, dtype=np.uint8)
        with joined(UcxBackend("prefill", same_host_copy=opt), UcxBackend("decode", same_host_copy=opt, **decode_options),
                    src, dst) as (a, b):
            yield a, b, src, dst

    @pytest.fixture(params=["copy", "rma"])
    def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
        """Two backends in this process, on the same-host copy path or on UCX RMA."""
        for a, b, src, dst in _pair(PATHS[request.param], 64 * 1024, 1):
            assert b.peer_path("prefill")[0] == a.peer_path("decode")[0] == PATH_NAMES[request.param]
            yield a, b, src, dst

    @pytest.fixture
    def copy_pair() -> Iterator[Pair]:
        """prefill holds a 4 MiB pattern, decode 4 MiB of sentinel; both on the copy path."""
        for a, b, src, dst in _pair(None, 4 << 20, 11, copy_chunk=64 << 10):
            assert b.peer_path("prefill")[0] == "same-host-copy", b.peer_path("prefill")
            yield a, b, src, dst
