"""The reply fields docs/protocol.md lists, read from the document itself, so a test can hold code and document to
each other: `status` (what every stage reports, what real mode adds) and the ready line."""

from __future__ import annotations

import re
from pathlib import Path

PROTOCOL = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def _names(text: str) -> set[str]:
    """The field names of a `{a, b: ..., c}` list (a value after a colon is not a name)."""
    return {part.split(":")[0].strip().strip('"') for part in re.sub(r"\[[^]]*\)", "", text).split(",")} - {""}


def status_fields() -> tuple[set[str], set[str]]:
    """(every stage's status fields, those real mode adds), as the ops table lists them."""
    row = next(line for line in PROTOCOL.read_text().splitlines() if line.startswith("| `status` |"))
    common, real = re.search(r"`\{([^}]*)\}`, in real mode also `([^`]*)`", row).groups()  # type: ignore[union-attr]
    return _names(common), _names(real)


def ready_fields() -> set[str]:
    """The ready line's fields on every stage (real mode adds status's real-mode fields)."""
    text = " ".join(PROTOCOL.read_text().split())
    listed = re.search(r"The ready line: `\{([^}]*)\}`", text).group(1)  # type: ignore[union-attr]
    return _names(listed)
