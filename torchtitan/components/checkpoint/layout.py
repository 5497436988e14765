"""The names of a checkpoint folder's entries (the package's `__init__` describes the layout)."""

import re
from pathlib import Path

INCOMPLETE_SUFFIX = ".incomplete"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def _incomplete(path: Path) -> Path:
    return path.with_name(path.name + INCOMPLETE_SUFFIX)


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint (`step-N` folders) in `folder`, ascending."""
    if not folder.is_dir():
        return []
    steps = [int(m.group(1)) for entry in folder.iterdir() if entry.is_dir() and (m := _STEP_FOLDER.match(entry.name))]
    return sorted(steps)
