"""Checks on the folders a command will write, made before any work starts."""

from __future__ import annotations

import os
from pathlib import Path


def folder_problem(path: str) -> str | None:
    """Why `path` could not be made or written as a folder, or None. Checked on its nearest
    existing ancestor, so nothing is created here."""
    folder = Path(path).absolute()
    if folder.exists() and not folder.is_dir():
        return "not a folder"
    ancestor = folder
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a folder"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable"
    return None
