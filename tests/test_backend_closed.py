"""A closed backend refuses every call with one typed error, whichever backend it is."""

from __future__ import annotations

import numpy as np
import pytest

import kvxfer
from kvxfer import DescriptorList, MemoryKind
from kvxfer.errors import AgentClosedError, BackendClosedError, BackendError
from kvxfer.plugin.registry import get_backend_class

BACKENDS = ["loopback", "ucx", "nixl"]


def _open(name: str) -> kvxfer.Backend:
    status = {s.name: s for s in kvxfer.available_backends()}[name]
    if not status.available:
        pytest.skip(f"{name}: {status.reason}")
    return get_backend_class(name)(f"closed-{name}")


@pytest.mark.parametrize("name", BACKENDS)
def test_closed_backend_raises_backend_closed_error(name: str) -> None:
    b = _open(name)
    buf = np.zeros(4096, np.uint8)
    descs = DescriptorList([[buf.ctypes.data, 4096, 0]], MemoryKind.DRAM)
    assert isinstance(b.local_metadata(), bytes)  # control: open, it answers
    b.close()
    for call in (b.local_metadata, lambda: b.prepare(None, descs)):
        with pytest.raises(BackendClosedError) as err:
            call()
        assert isinstance(err.value, AgentClosedError) and isinstance(err.value, BackendError)  # both old types
