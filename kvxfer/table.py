"""One table printer for the command line, the demo and the benchmark scripts.

Callers describe each column once (key, header, format) and pass rows as dicts, so the same
rows can be printed as a table or dumped as JSON without a second formatting path. rich
draws the table; cell text is never parsed as markup, so an install hint such as
``pip install 'kvxfer[nixl]'`` prints as written.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Mapping, Sequence

__all__ = ["Column", "console", "render", "print_table", "emit", "dumps", "gb", "ms", "count"]

#: Width used when output is not a terminal (pipes, tests, README captures): never wrap.
PIPE_WIDTH = 200


@dataclass(frozen=True)
class Column:
    """One column: ``key`` into each row, its ``header``, and how a value becomes text.

    ``fmt`` is a ``str.format`` pattern or a callable; ``None`` values print as ``-``.
    ``justify`` defaults to right for numbers and left for everything else.
    """

    key: str
    header: str | None = None
    fmt: str | Callable[[Any], str] = "{}"
    justify: str | None = None

    def text(self, row: Mapping[str, Any]) -> str:
        v = row.get(self.key)
        if v is None:
            return "-"
        return self.fmt(v) if callable(self.fmt) else self.fmt.format(v)

    def align(self, rows: Sequence[Mapping[str, Any]]) -> str:
        if self.justify:
            return self.justify
        vals = [r.get(self.key) for r in rows if r.get(self.key) is not None]
        numeric = bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
        return "right" if numeric else "left"


def gb(v: float) -> str:
    return f"{v / 1e9:.3f}"


def ms(v: float) -> str:
    return f"{v * 1e3:.3f}"


def count(v: int) -> str:
    return f"{v:,}"


def console(*, stderr: bool = False, file: IO[str] | None = None) -> Any:
    """A rich console that does not wrap when writing to a pipe or a file."""
    from rich.console import Console

    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(file=stream, width=None if tty else PIPE_WIDTH, highlight=False, emoji=False,
                   soft_wrap=not tty)


def render(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column | str], *, title: str | None = None,
           caption: str | None = None) -> Any:
    """The rich ``Table`` for ``rows``; a plain string column spec is a key used as header."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rows = list(rows)
    cols = [c if isinstance(c, Column) else Column(c) for c in columns]
    table = Table(title=Text(title) if title else None, caption=Text(caption) if caption else None,
                  box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", caption_justify="left",
                  pad_edge=False)
    for c in cols:
        table.add_column(Text(c.header if c.header is not None else c.key), justify=c.align(rows),  # type: ignore[arg-type]
                         overflow="fold")
    for r in rows:
        table.add_row(*(Text(c.text(r)) for c in cols))
    return table


def print_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column | str], *, title: str | None = None,
                caption: str | None = None, file: IO[str] | None = None) -> None:
    """Print ``rows`` as a table (to stdout unless ``file`` is given)."""
    emit(render(rows, columns, title=title, caption=caption), file=file)


def emit(renderable: Any, *, file: IO[str] | None = None) -> None:
    """Print a rich renderable; into a pipe or file as plain text without trailing blanks."""
    stream = file if file is not None else sys.stdout
    con = console(file=stream)
    if con.is_terminal:
        con.print(renderable)
        return
    with con.capture() as cap:
        con.print(renderable)
    text = "\n".join(line.rstrip() for line in cap.get().splitlines())
    stream.write(text.strip("\n") + "\n")
    stream.flush()


def dumps(obj: Any) -> str:
    """JSON for ``--json`` output: dataclasses, enums, numpy scalars and paths included."""
    return json.dumps(obj, indent=2, default=_default)


def _default(o: Any) -> Any:
    import dataclasses
    import enum
    import os

    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, enum.Enum):
        return o.value
    if isinstance(o, (set, frozenset, tuple)):
        return sorted(o, key=str) if isinstance(o, (set, frozenset)) else list(o)
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    return str(o)
