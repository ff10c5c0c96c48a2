"""Every backend option is written down: in its plugin's table, in docs/backends.md, in the CLI.

What a backend accepts is read from its constructor (:func:`kvxfer.plugin.backend.backend_options`,
the same rule the core uses to refuse a misspelt option), never from a list kept by hand, so a
new keyword without a row fails here. The controls show the check failing: a backend with one
extra keyword, and a table with one row missing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvxfer.plugin import Option
from kvxfer.plugin.backend import Backend, undocumented_options
from kvxfer.plugin.registry import registry

from test_cli import kvxfer_cmd

DOC = Path(__file__).resolve().parents[1] / "docs" / "backends.md"
IN_TREE = ("nixl", "ucx", "loopback", "mooncake")  # mooncake: its own distribution, which make test installs


def _loadable(name: str) -> type[Backend]:
    info = registry()[name]
    if info.unavailable_reason() is not None:
        pytest.skip(f"{name} cannot run here: {info.unavailable_reason()}")
    return info.load()


def doc_tables() -> dict[str, list[tuple[str, str]]]:
    """``{backend: [(option, default), ...]}`` from the tables under each ``## `name``` heading."""
    tables: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        m = re.match(r"^## `([\w.-]+)`", line)
        if m:
            current = m.group(1)
            tables[current] = []
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if current and len(cells) == 4 and cells[0].startswith("`"):
            tables[current].append((cells[0].strip("`"), cells[1].strip("`").replace("\\|", "|")))
    return tables


@pytest.mark.parametrize("name", IN_TREE)
def test_every_accepted_option_has_a_row(name: str) -> None:
    assert undocumented_options(_loadable(name), registry()[name].options) == []


@pytest.mark.parametrize("name", IN_TREE)
def test_docs_table_is_the_registered_table(name: str) -> None:
    assert doc_tables()[name] == [(o.name, o.default) for o in registry()[name].options]


def test_control_an_extra_keyword_or_a_missing_row_is_caught() -> None:
    cls = _loadable("nixl")
    rows = registry()["nixl"].options

    class Wider(cls):  # type: ignore[misc, valid-type]
        def __init__(self, agent_name: str, *, shiny: int = 0, **options: object) -> None: ...

    assert "shiny" in undocumented_options(Wider, rows)
    assert undocumented_options(cls, rows[1:]) == [rows[0].name]
    assert undocumented_options(cls, (*rows, Option("gone", "0", "", ""))) == ["gone (listed, not accepted)"]


def test_cli_shows_every_option() -> None:
    r = kvxfer_cmd("backends", "--options", "ucx", timeout=120)
    assert r.returncode == 0, r.stderr
    for o in registry()["ucx"].options:
        assert re.search(rf"^{o.name}\s", r.stdout, re.M), o.name
    bad = kvxfer_cmd("backends", "--options", "no-such-backend", timeout=120)
    assert bad.returncode == 2 and "no backend 'no-such-backend'" in bad.stderr


def test_readme_links_the_tables() -> None:
    readme = (DOC.parents[1] / "README.md").read_text()
    section = readme.split("## Backends", 1)[1].split("\n## ", 1)[0]
    assert "docs/backends.md" in section


def test_registering_a_row_that_is_not_an_option_is_refused() -> None:
    from kvxfer.errors import KvxferError
    from kvxfer.plugin.registry import _registrar  # type: ignore[attr-defined]

    register = _registrar("p", {})
    with pytest.raises(KvxferError, match="Option rows"):
        register("x", "m:C", options=[("opt", "0")])  # type: ignore[list-item]
