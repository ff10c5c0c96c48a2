"""``kvxfer demo``: the options live with the demo itself (:mod:`kvxfer.demo`)."""

from __future__ import annotations

from typing import Any


def add_parser(sub: Any) -> None:
    from .. import demo
    from .args import plain

    p = sub.add_parser("demo", help="prefill and decode move a real KV request, verify it and show the costs",
                       description=plain(demo.__doc__))
    demo.add_arguments(p)
    p.set_defaults(fn=demo.run)
