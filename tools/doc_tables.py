"""The generated tables of the docs (tools/planted_bugs.py, tools/planted_slowdowns.py): a table written between two
markers of a Markdown file, whole or merged row by row, so that regenerating some rows keeps the others."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def merge_rows(text: str, rule: str, rows: list[list[str]], key: int, group: slice) -> str:
    """The table `text` (its header ends with the line `rule`) with `rows` in place of the rows whose first `key`
    cells are theirs; a new row goes after the last row of the same `group` of cells (else at the end)."""
    lines = text.rstrip("\n").split("\n")
    start = lines.index(rule) + 1
    body = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in lines[start:]]
    for row in rows:
        at = next((i for i, old in enumerate(body) if old[:key] == row[:key]), None)
        if at is not None:
            body[at] = row
            continue
        same = [i for i, old in enumerate(body) if old[group] == row[group]]
        body.insert(same[-1] + 1 if same else len(body), row)
    return "\n".join([*lines[:start], *("| " + " | ".join(r) + " |" for r in body)]) + "\n"


def write_between(path: Path, begin: str, end: str, text: Callable[[str], str]) -> str | None:
    """Replace what stands between the markers `begin` and `end` of `path` with `text(what stood there)`; None, or
    why nothing was written."""
    doc = path.read_text()
    if begin not in doc or end not in doc:
        return f"{path}: no {begin} ... {end} markers"
    before, rest = doc.split(begin, 1)
    old, after = rest.split(end, 1)
    path.write_text(f"{before}{begin}\n{text(old)}{end}{after}")
    return None
