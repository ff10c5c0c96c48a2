"""Fenced blocks of the Markdown docs, for the tests that run them (``tests/test_docs.py``).

A block is named ``FILE:LINE`` (the line of its opening fence) unless a
``<!-- sketch: NAME -->`` line sits right above it: such a block is only a sketch (it needs
a service the tests do not start) and is excluded by that name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "CONTRIBUTING.md", "docs/*.md")
_SKETCH = re.compile(r"^<!--\s*sketch:\s*([\w.-]+)\s*-->$")


@dataclass(frozen=True)
class Block:
    file: str   # relative to the repository
    line: int   # 1-based line of the opening fence
    lang: str
    text: str
    sketch: str | None  # the name it is excluded by, or None

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line}"


def doc_files() -> list[Path]:
    out: list[Path] = []
    for pattern in DOCS:
        out += sorted(REPO.glob(pattern))
    return out


def blocks(path: Path) -> list[Block]:
    """Every fenced block of one file, in order."""
    rel = str(path.relative_to(REPO))
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        above = _SKETCH.match(lines[start - 1].strip()) if start else None
        out.append(Block(rel, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n",
                         above.group(1) if above else None))
        i = end + 1
    return out


def all_blocks(lang: str) -> list[Block]:
    return [b for f in doc_files() for b in blocks(f) if b.lang == lang]


@dataclass(frozen=True)
class Example:
    """One ``$ command`` of a text block and the output the doc shows for it."""

    block: Block
    command: str
    output: list[str]


def cli_examples() -> list[Example]:
    out: list[Example] = []
    for b in all_blocks("text"):
        current: tuple[str, list[str]] | None = None
        for line in b.text.splitlines():
            if line.startswith("$ "):
                if current:
                    out.append(Example(b, *current))
                current = (line[2:].strip(), [])
            elif current is not None:
                current[1].append(line)
        if current:
            out.append(Example(b, *current))
    return out


def is_rule(line: str) -> bool:
    s = line.strip()
    return bool(s) and set(s) <= {"─", "━", "-"}


def columns(header: str) -> list[str]:
    return [c for c in re.split(r"\s{2,}", header.strip()) if c]


def shape(output: list[str]) -> list[tuple[str, ...]]:
    """What must match between the doc and a run: table headers, row and line kinds.

    Numbers and row contents change from machine to machine; the columns of every table,
    how many rows it has and what each row starts with, and the words that open each
    line outside a table must not.
    """
    out: list[tuple[str, ...]] = []
    lines = [ln for ln in output if ln.strip()]
    in_table = False
    for i, ln in enumerate(lines):
        if i + 1 < len(lines) and is_rule(lines[i + 1]) and not is_rule(ln):
            out.append(("header", *columns(ln)))
            in_table = True
        elif is_rule(ln):
            continue
        elif in_table and ln.startswith(" "):
            continue  # a wrapped cell
        elif in_table and len(columns(ln)) > 1:
            out.append(("row", _word(ln)))
        else:
            in_table = False
            out.append(("text", *[_word(w) for w in ln.split()[:2]]))
    return out


def _word(text: str) -> str:
    return re.sub(r"\d[\d,.]*", "N", text.split()[0])
