"""The operator sees a metadata prover that cannot start: a counter, not only a log line.

A real prover whose helper fails to start (its target does not exist) is asked once; the
connector's stats then carry ``prover_start_failures`` and ``prover_unavailable``, which
become ``vllm:kvxfer_prover_*`` counters. A second look counts nothing new (the control:
the counter follows the prover, it does not grow by itself).
"""

from __future__ import annotations

import pytest

from kvxfer.errors import ProverUnavailableError
from kvxfer.integrations.vllm.config import ConnectorConfig
from kvxfer.integrations.vllm.worker import WorkerSide
from kvxfer.prove import Prover


def test_a_prover_that_cannot_start_reaches_the_metrics() -> None:
    side = WorkerSide(ConnectorConfig.from_extra({"insecure": True, "port": 1}, env={}), "metrics", 0)
    side.take_stats()  # whatever earlier tests' provers counted in this process
    p = Prover("kvxfer.testing.no_such_module:factory")
    try:
        with pytest.raises(ProverUnavailableError):
            p.prove(b"anything")
        stats = side.take_stats()
        assert stats is not None
        assert sum(stats.data["prover_start_failures"]) == 1 and sum(stats.data["prover_unavailable"]) == 1
        assert stats.reduce()["prover_start_failures"] == 1
        assert side.take_stats() is None
    finally:
        p.close()
        side.close()
