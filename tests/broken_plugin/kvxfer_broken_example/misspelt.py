"""A plugin that misspells its hook: without check_pending() it would silently do nothing."""

from typing import Any

import kvxfer


@kvxfer.hookimpl
def kvxfer_register_backend(register: Any) -> None:  # the hook is kvxfer_register_backends
    register("never-seen", "kvxfer_loopback.backend:LoopbackBackend")
