"""A plugin that registers one backend and then raises: none of its backends may appear."""

from typing import Any

import kvxfer


@kvxfer.hookimpl
def kvxfer_register_backends(register: Any) -> None:
    register("half-registered", "kvxfer_loopback.backend:LoopbackBackend")
    raise RuntimeError("registration blew up")
