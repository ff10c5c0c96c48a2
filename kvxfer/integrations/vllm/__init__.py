"""kvxfer as a vLLM KV connector, loaded out of tree (no patch to vLLM)::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.integrations.vllm",
                           "kv_role": "kv_both", ...}'

Pull mode: prefill keeps a finished request's blocks and returns transfer parameters;
decode READs the blocks through a kvxfer Agent (NIXL by default) after fetching the
prefill's metadata over kvxfer's side channel. The supported vLLM range is checked here,
at import, before vLLM's connector interface is touched. See README.md, "Use with vLLM".
"""

from __future__ import annotations

from ._compat import SUPPORTED, VllmVersionError, check_vllm

check_vllm()

from .connector import KvxferConnector  # noqa: E402

__all__ = ["KvxferConnector", "SUPPORTED", "VllmVersionError", "check_vllm"]
