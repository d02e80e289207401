"""Checks on the folders a command will write, made before any work starts."""

from __future__ import annotations

import tempfile
from pathlib import Path


def folder_problem(path: str) -> str | None:
    """Why `path` could not be made or written as a folder, or None. Checked on its nearest
    existing ancestor (a file made there and removed at once), so no folder is created here."""
    folder = Path(path).absolute()
    if folder.exists() and not folder.is_dir():
        return "not a folder"
    ancestor = folder
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a folder"
    # A file made and removed there: permission bits alone pass for root on a read-only mount
    # or in /proc.
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        return f"{ancestor} is not writable ({e.strerror})"
    return None
