"""Removing a finished run's tier folders while the next run sets up, never while a run is measured.

Why: deleting a run's local tier (up to 12 GiB of chunk files on the default workload) took 8-11 s on the project
VM, whose root file system is mounted with ``discard`` (every freed block is discarded as it is unlinked: a 1 GiB
file written with O_DIRECT takes 0.8 s to ``rm``, one only ``fallocate``-d 0.05 s). The replay paid that after each
of its 8 runs, and ``make demo`` ran over its 10 minutes. Deleting in the background during the next run would
confound it: while a 4 GiB file was removed, an O_DIRECT read of another file on the disk ran at 342-351 MB/s
against 797-815 MB/s alone. So the deletion overlaps only the next run's set-up (opening its store, making its
host memory resident: 0.7-7 s, the hypervisor's cost of handing memory back), and the run waits for it to finish
before its clock starts (:meth:`FolderRemoval.wait`); no device probe starts while one is in flight
(:meth:`FolderRemoval.quiet`).

Each folder goes through: renamed aside (same parent, so the same file system: instant; a run that reuses the
name, ``--systems kvstream --rounds 2``, makes a fresh folder, never one being deleted) -> held (optional) ->
deleting (in the background, a thread per device) -> gone. Invariants: at most one deletion is in flight (each
new one waits for the one before); a held folder is only renamed, never touched, until :meth:`begin` or
:meth:`wait`; and :meth:`wait` returns only when nothing is held or being deleted. A replay stopped before
:meth:`wait` leaves its folders renamed aside; the next replay on the same tiers finds them (:func:`left_aside`)
and deletes them before its first probe.

Holding is for folders a device probe may sit beside without harm: a round's last run's, and the probe's own. They
wait, untouched, while the next round's probe measures the devices (:meth:`quiet` waits only for a deletion in
flight), and go while the next run sets up (:meth:`begin` at its start), which nothing overlapped before. The
last round's go while the report and figure are made. Deleting costs the same either way (on this VM's disk
0.7 s per GiB *written*, fallocated first or not: the host frees written blocks); what holding saves is the
waiting that nothing overlapped.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path

__all__ = ["FolderRemoval", "left_aside"]

_ASIDE = ".removing-"  # a folder renamed aside: <name>.removing-<8 hex>


def _is_aside(folder: Path) -> bool:
    """Whether ``folder`` is one a :class:`FolderRemoval` renamed aside (to be deleted)."""
    return _ASIDE in folder.name


def left_aside(base: Path, prefix: str) -> list[Path]:
    """The folders under ``base`` named ``<prefix>*`` that a :class:`FolderRemoval` renamed aside and never
    deleted: a replay stopped (killed, or its machine lost) while it held them or was deleting them. Each is up to
    a tier's capacity of chunk files nobody will read."""
    return sorted(p for p in base.glob(f"{prefix}*{_ASIDE}*") if p.is_dir() and not p.is_symlink())


class FolderRemoval:
    """One background deletion of a set of folders at a time; :meth:`wait` before anything that is measured."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []  # the deletion in flight: one thread per device
        self._held: list[Path] = []

    def start(self, folders: Iterable[Path]) -> list[Path]:
        """Rename each existing folder aside and delete the renamed folders (and any held ones) in the background
        (:meth:`begin`), once the deletion in flight has finished. Returns the names they were renamed to (gone when
        :meth:`wait` returns). A folder that cannot be renamed is deleted where it is, in the background too."""
        aside = self.hold(folders)
        self.begin()
        return aside

    def hold(self, folders: Iterable[Path]) -> list[Path]:
        """Rename each existing folder aside and keep it, untouched, until :meth:`begin` or :meth:`wait`. Returns
        the names they were renamed to."""
        aside = []
        for d in folders:
            if not d.exists():
                continue
            if _is_aside(d):  # already renamed aside (left by a replay that was stopped): deleted as it is
                aside.append(d)
                continue
            target = d.with_name(f"{d.name}{_ASIDE}{uuid.uuid4().hex[:8]}")
            try:
                d.rename(target)
            except OSError:
                target = d
            aside.append(target)
        self._held.extend(aside)
        return aside

    def begin(self) -> None:
        """Delete the held folders in the background, once the deletion in flight (if any) has finished: one thread
        per device (a replay's local tier on the disk, its emulated shared tier in RAM), so a RAM folder's second
        of freeing pages does not queue behind the disk's discards. Folders on one device go one after another
        (parallel ``rm`` on this disk was no faster)."""
        self.quiet()
        by_device: dict[int, list[Path]] = {}
        for d in self._held:
            try:
                dev = d.stat().st_dev
            except OSError:
                dev = -1  # gone already, or unreadable: rmtree(ignore_errors) deals with it
            by_device.setdefault(dev, []).append(d)
        self._held = []
        for dev, folders in by_device.items():
            t = threading.Thread(target=self._remove, args=(folders,), name=f"kvstream-replay-rmtree-{dev}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    @staticmethod
    def _remove(folders: list[Path]) -> None:
        for d in folders:
            shutil.rmtree(d, ignore_errors=True)

    def quiet(self) -> None:
        """Return when no deletion is in flight (held folders stay held): the devices are idle for a probe."""
        for t in self._threads:
            t.join()
        self._threads = []

    def wait(self) -> None:
        """Delete whatever is held and return when every folder handed over is gone."""
        self.begin()
        self.quiet()
