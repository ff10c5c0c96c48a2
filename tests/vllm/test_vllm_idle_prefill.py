"""Decode loads from a prefill whose engine has gone idle (no steps, so no connector calls).

vLLM steps an engine only while it has requests to run; after prefill hands out its last
transfer parameters nothing calls its connector until the next request. The decode's READ
must still finish: the prefill worker drives the transport itself while blocks are leased.
Real bytes between two processes over NIXL, checked against torch indexing over the views.
"""

from __future__ import annotations

import pytest

from idle_prefill import load_from_idle_prefill

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess, pytest.mark.nixl]


def test_decode_loads_from_an_idle_prefill() -> None:
    load_from_idle_prefill()
