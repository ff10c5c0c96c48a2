"""Test-only: switch off the decode's prompt binding while a trigger file exists (the control).

tests/vllm/e2e.py puts this directory on ``PYTHONPATH`` of the LBHNC pair's decode only, with
``KVXFER_E2E_UNBOUND`` naming the trigger file. Every process vLLM spawns runs this file; it
imports nothing heavy at start-up: it patches ``SchedulerSide.check_prompt`` when the
connector's scheduler module is first imported, and the patched check does nothing only while
the file exists.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "kvxfer.integrations.vllm.scheduler"


def _patch(module):
    real = module.SchedulerSide.check_prompt
    trigger = os.environ["KVXFER_E2E_UNBOUND"]

    def check_prompt(request, remote):
        if not os.path.exists(trigger):
            real(request, remote)

    module.SchedulerSide.check_prompt = staticmethod(check_prompt)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader.exec_module

        def exec_module(module):
            inner(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("KVXFER_E2E_UNBOUND"):
    sys.meta_path.insert(0, _Finder())
