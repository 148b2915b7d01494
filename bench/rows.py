"""The bench table: one ``Row`` per measured value, its target (if the issue sets one) and PASS/MISS.

Rows are plain data so the table can be printed and written as JSON from the same list.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Row:
    """A measured value. ``target`` is a lower bound, or an upper bound when ``at_most`` (RSS)."""

    section: str  # e.g. "1 single stream"
    name: str  # what was measured, e.g. "pp_worker 2 stages"
    value: float | None  # None: the measurement failed (see note)
    unit: str
    target: float | None = None
    at_most: bool = False
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        if self.value is None:
            return "n/a"  # not measured (a section failed or was not run): neither met nor missed
        ok = self.value <= self.target if self.at_most else self.value >= self.target
        return "PASS" if ok else "MISS"

    @property
    def target_text(self) -> str:
        if self.target is None:
            return ""
        return f"{'<=' if self.at_most else '>='} {number(self.target)}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "target_text": self.target_text, "verdict": self.verdict}


def number(x: float | None) -> str:
    """Three significant figures, thousands separated: 0.912, 41.8, 23,400."""
    if x is None:
        return "n/a"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


COLUMNS = ("measurement", "value", "unit", "target", "result", "note")


def render(rows: list[Row]) -> str:
    """A fixed-width text table, a header line per section."""
    cells = [(r.name, number(r.value), r.unit, r.target_text, r.verdict, r.note) for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(COLUMNS[:-1])]
    lines, section = [_line(COLUMNS, widths)], None
    lines.append("-" * len(lines[0]))
    for r, row in zip(rows, cells, strict=True):
        if r.section != section:
            section = r.section
            lines.append(f"[{section}]")
        lines.append(_line(row, widths))
    return "\n".join(lines)


def _line(cells: tuple[str, ...], widths: list[int]) -> str:
    *fixed, note = cells
    pairs = enumerate(zip(fixed, widths, strict=True))
    left = "  ".join(c.rjust(w) if i == 1 else c.ljust(w) for i, (c, w) in pairs)  # numbers right-aligned
    return f"{left}  {note}".rstrip()


def summary(rows: list[Row]) -> str:
    verdicts = [r.verdict for r in rows if r.verdict]
    text = f"targets: {verdicts.count('PASS')} PASS, {verdicts.count('MISS')} MISS of {len(verdicts)}"
    return text + (f" ({verdicts.count('n/a')} not measured)" if "n/a" in verdicts else "")


def to_json(rows: list[Row], meta: dict[str, Any]) -> dict[str, Any]:
    return {**meta, "rows": [r.as_dict() for r in rows], "summary": summary(rows)}


def write_results(doc: dict[str, Any], directory: Path, stamp: str, latest: str = "latest.json") -> list[Path]:
    """``<stamp>.json`` and a copy named ``latest`` under ``directory``; returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=2) + "\n"
    paths = [directory / f"{stamp}.json", directory / latest]
    for path in paths:
        path.write_text(text)
    return paths
