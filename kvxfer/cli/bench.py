from typing import Any
def add_parser(sub: Any) -> None:
    sub.add_parser("bench")
