"""Removing a finished run's tier folders while the next run sets up, never while a run is measured.

Why: deleting a run's local tier (up to 12 GiB of chunk files on the default workload) took 8-11 s on the project
VM, whose root file system is mounted with ``discard`` (every freed block is discarded as it is unlinked: a 1 GiB
file written with O_DIRECT takes 0.8 s to ``rm``, one only ``fallocate``-d 0.05 s). The replay paid that after each
of its 8 runs, and ``make demo`` ran over its 10 minutes. Deleting in the background during the next run would
confound it: while a 4 GiB file was removed, an O_DIRECT read of another file on the disk ran at 342-351 MB/s
against 797-815 MB/s alone. So the deletion overlaps only the next run's set-up (opening its store, making its
host memory resident: 0.7-7 s, the hypervisor's cost of handing memory back), and the run waits for it to finish
before its clock starts (:meth:`FolderRemoval.wait`), as does every device probe.

Invariant: at most one removal is in flight; :meth:`start` waits for the one before. The folders are renamed
aside first (same parent, so the same file system: instant), so a run that reuses a name (``--systems kvstream
--rounds 2``) makes a fresh folder, never one being deleted.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path

__all__ = ["FolderRemoval"]


class FolderRemoval:
    """One background ``rmtree`` of a set of folders at a time; :meth:`wait` before anything that is measured."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, folders: Iterable[Path]) -> list[Path]:
        """Rename each existing folder aside and delete the renamed folders in a background thread. Returns the
        names they were renamed to (already deleted when :meth:`wait` returns). A folder that cannot be renamed
        is deleted where it is, in the background too."""
        self.wait()
        aside = []
        for d in folders:
            if not d.exists():
                continue
            target = d.with_name(f"{d.name}.removing-{uuid.uuid4().hex[:8]}")
            try:
                d.rename(target)
            except OSError:
                target = d
            aside.append(target)
        if aside:
            self._thread = threading.Thread(target=self._remove, args=(aside,), name="kvstream-replay-rmtree",
                                            daemon=True)
            self._thread.start()
        return aside

    @staticmethod
    def _remove(folders: list[Path]) -> None:
        for d in folders:
            shutil.rmtree(d, ignore_errors=True)

    def wait(self) -> None:
        """Return when the removal in flight (if any) has finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
