"""Adapters that plug kvxfer into serving engines.

Each adapter imports its engine, so none of them is imported by ``import kvxfer``: the
engine loads the one it needs by module path (for vLLM, ``kvxfer.integrations.vllm``
through ``kv_connector_module_path``).
"""
