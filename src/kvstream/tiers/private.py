"""Folders only this user can enter, whatever the process umask (SECURITY.md, control 1).

``Path.mkdir(parents=True)`` and ``os.makedirs`` give their mode to the last level only: the parents they
create get ``0777 & ~umask``, so under umask 0 a tier at ``/data/new/tier`` made ``/data/new`` world-writable.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["mkdir_private"]


def mkdir_private(path: Path | str) -> None:
    """Create ``path`` and every missing parent with mode 0700 (the umask can only take bits away). Folders that
    already exist are left as they are; two processes creating the same folder at once both succeed."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
