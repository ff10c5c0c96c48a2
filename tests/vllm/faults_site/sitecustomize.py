"""Test-only: make kvxfer's corrupting fault backend (``"corrupting"``) exist in this engine.

tests/vllm/test_vllm_integrity.py puts this directory on ``PYTHONPATH`` of its two engines
only; every process vLLM spawns runs this file, so the backend exists wherever the
connector's agent is created. It corrupts nothing until the test's trigger file exists.
"""

from kvxfer._harness import faults

faults.install()
