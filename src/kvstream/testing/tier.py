"""The tier contract's conformance suite: :class:`TierConformance`, one subclass per tier kind.

A subclass says how to open its tier; every test method here then runs against it::

    class TestMyTier(TierConformance):
        @pytest.fixture
        def tier_root(self, tmp_path):          # where tiers are opened (default: pytest's tmp_path)
            return tmp_path

        def open_tier(self, root, *, node="node-a"):
            return MyTier(root, capacity_bytes=self.capacity_chunks * CHUNK, node=node)

The tier's :class:`~kvstream.tiers.contract.TierCapabilities` decide which tests apply: a modelled tier skips the
byte-level ones, a tier that is not durable the crash ones, and so on; each skip names the flag. The invariants
tested are the contract's (:mod:`kvstream.tiers.contract`, numbered there): first wins (racing threads and, on a
shared tier, racing nodes), all or nothing (a killed writer's temporary is never a chunk), never other bytes (a
descriptor opened before a drop, readers racing drops and publishes), bounded sizes (a file on disk that lies
about its size, something that is not a file at a chunk's path), capacity (eviction, reservations, pins).

Every chunk the suite writes is ``PAYLOAD`` bytes, so ``CHUNK`` bytes on the tier; tiers get room for
``capacity_chunks`` of them, evicting least recently used first (the default policy of every tier kind).
Requires pytest (the ``test`` extra); numpy for payloads.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kvstream.format import file_size
from kvstream.testing.tier_io import IO_TIMEOUT_S, Failed, Miss, Refused, read_chunk, read_open, write_chunk, \
    write_temp
from kvstream.testing.tier_model import run_model
from kvstream.tiers.contract import FileTier, ModelledTier, Tier

__all__ = ["TierConformance", "PAYLOAD", "CHUNK", "payload", "key"]

PAYLOAD = 8192
CHUNK = file_size(PAYLOAD)  # bytes each chunk of the suite takes on a tier


def payload(tag: int) -> bytes:
    """Distinct bytes for each tag (seeded): a read of the wrong version cannot pass for the right one."""
    return np.random.default_rng(tag).bytes(PAYLOAD)


def key(i: int) -> bytes:
    return b"conformance-%08d" % i


class TierConformance:
    """Conformance tests of the tier contract; subclass it and define :meth:`open_tier` (see the module)."""

    capacity_chunks: ClassVar[int] = 8  # the tier's capacity, in the suite's chunks
    read_faults: ClassVar[bool] = False  # the tier's reads fail now and then (a fault wrapper): retried, counted
    _clock = 0.0  # a modelled tier's time: one second per publish

    def open_tier(self, root: Path, *, node: str = "node-a") -> Tier[Any]:
        """A new tier object on ``root`` (the same folder again: a reopen) as node ``node``, with room for
        ``capacity_chunks`` chunks of ``CHUNK`` bytes. It must build everything it uses afresh (its I/O engine
        included): the crash test calls it in a forked child."""
        raise NotImplementedError(f"{type(self).__name__} must define open_tier(root, *, node)")

    # -- fixtures -------------------------------------------------------------------------------------------
    @pytest.fixture
    def tier_root(self, tmp_path: Path) -> Path:
        """Where the tier lives; override to put it on the file system the tier needs (O_DIRECT: not tmpfs)."""
        return tmp_path

    @pytest.fixture
    def opener(self, tier_root: Path) -> Iterator[Callable[..., Tier[Any]]]:
        """Open tiers on ``tier_root`` (``opener(node=...)``); every one is closed after the test."""
        opened: list[Tier[Any]] = []

        def open_(node: str = "node-a") -> Tier[Any]:
            t = self.open_tier(tier_root, node=node)
            opened.append(t)
            return t

        yield open_
        for t in reversed(opened):
            close = getattr(t, "close", None)
            if close is not None:
                close()

    @pytest.fixture
    def tier(self, opener: Callable[..., Tier[Any]]) -> Tier[Any]:
        return opener()

    # -- helpers --------------------------------------------------------------------------------------------
    @staticmethod
    def files(tier: Tier[Any], why: str = "") -> FileTier:
        """The tier as a file tier, or skip: a modelled tier has no bytes, descriptors or files."""
        if tier.capabilities.modelled:
            pytest.skip(f"capability modelled=True: the tier holds no bytes{why}")
        assert isinstance(tier, FileTier), "a tier that is not modelled implements FileTier"
        return tier

    def put(self, tier: Tier[Any], k: bytes, data: bytes) -> bool | Refused:
        """Publish one chunk the way the engine does for this kind of tier; ``publish``'s answer."""
        if tier.capabilities.modelled:
            assert isinstance(tier, ModelledTier), "a modelled tier implements ModelledTier"
            self._clock += 1.0
            won = tier.publish(k, file_size(len(data)), now=self._clock)
            tier.fit(now=self._clock)
            return won
        return write_chunk(self.files(tier), k, data)

    def expect(self, tier: Tier[Any], k: bytes, data: bytes) -> None:
        """The tier holds ``k`` as ``data``: listed, its size, and (a file tier) its bytes read back verified."""
        assert tier.contains(k)
        assert tier.file_size(k) == file_size(len(data))
        if tier.capabilities.modelled:
            return
        ft = self.files(tier)
        for _ in range(40 if self.read_faults else 1):
            got = read_chunk(ft, k)
            if isinstance(got, Failed) and self.read_faults:
                continue
            assert got == data, f"read back {got!r:.80}, not the published bytes"
            return
        pytest.fail("40 reads in a row failed (injected faults at these rates should not do that)")

    def held(self, tier: Tier[Any], n: int) -> list[int]:
        return [i for i in range(n) if tier.contains(key(i))]

    # -- every tier -----------------------------------------------------------------------------------------
    def test_implements_the_contract(self, tier: Tier[Any]) -> None:
        assert isinstance(tier, Tier)
        want = ModelledTier if tier.capabilities.modelled else FileTier
        assert isinstance(tier, want), f"capabilities say modelled={tier.capabilities.modelled}: implement {want}"
        assert tier.capacity_bytes is None or tier.capacity_bytes >= CHUNK * self.capacity_chunks
        assert tier.used_bytes == 0

    def test_an_unknown_key_is_absent(self, tier: Tier[Any]) -> None:
        assert not tier.contains(key(0))
        assert tier.file_size(key(0)) is None
        if not tier.capabilities.modelled:
            assert isinstance(read_chunk(self.files(tier), key(0)), Miss)

    def test_publish_lists_the_chunk(self, tier: Tier[Any]) -> None:
        assert self.put(tier, key(0), payload(0)) is True
        self.expect(tier, key(0), payload(0))
        assert tier.used_bytes == CHUNK
        assert not tier.contains(key(1))

    def test_the_first_publish_wins(self, tier: Tier[Any]) -> None:
        assert self.put(tier, key(0), payload(0)) is True
        assert self.put(tier, key(0), payload(1)) is False
        self.expect(tier, key(0), payload(0))
        assert tier.used_bytes == CHUNK

    def test_a_lost_publish_does_not_refresh_the_chunk(self, tier: Tier[Any]) -> None:
        """First wins for eviction too: publishing a held key again does not make it recently used. (With room
        for it: on a full file tier the republish's own ``reserve`` may evict the key first, which is why the
        engine's writer asks ``contains`` before it reserves.)"""
        n = self.capacity_chunks
        for i in range(n - 1):
            assert self.put(tier, key(i), payload(i)) is True
        assert self.put(tier, key(0), payload(0)) is False
        assert self.put(tier, key(n - 1), payload(n - 1)) is True
        assert self.put(tier, key(n), payload(n)) is True
        assert not tier.contains(key(0)), "the oldest chunk is the victim, its lost republish notwithstanding"
        assert self.held(tier, n + 1) == list(range(1, n + 1))

    def test_capacity_is_kept_by_eviction(self, tier: Tier[Any]) -> None:
        n = self.capacity_chunks
        cap = tier.capacity_bytes
        assert cap is not None, "the suite's tiers are given a capacity"
        for i in range(3 * n):
            assert self.put(tier, key(i), payload(i)) is True
            assert tier.contains(key(i)), "room is made for the chunk being published"
            assert tier.used_bytes <= cap
        held = self.held(tier, 3 * n)
        assert held == list(range(2 * n, 3 * n)), "least recently used first"
        assert tier.used_bytes == CHUNK * len(held)
        for i in held[-2:]:
            self.expect(tier, key(i), payload(i))

    def test_matches_the_model(self, tier_root: Path) -> None:
        """Random publishes, republishes, drops and reopens (hypothesis' state machine) against an LRU model:
        :mod:`kvstream.testing.tier_model`."""
        run_model(lambda folder: self.open_tier(folder), tier_root, capacity=self.capacity_chunks, chunk=CHUNK,
                  payload=payload, key=key, read_faults=self.read_faults)

    # -- file tiers: capacity -------------------------------------------------------------------------------
    def test_reserve_refuses_what_can_never_fit(self, tier: Tier[Any]) -> None:
        ft = self.files(tier)
        assert self.put(ft, key(0), payload(0)) is True
        cap = ft.capacity_bytes
        assert cap is not None
        assert ft.reserve(cap + 1) is False
        assert ft.contains(key(0)) and ft.used_bytes == CHUNK, "nothing is evicted for a chunk that cannot fit"

    def test_reserve_makes_room_and_unreserve_returns_it(self, tier: Tier[Any]) -> None:
        ft = self.files(tier)
        n = self.capacity_chunks
        for i in range(n):
            self.put(ft, key(i), payload(i))
        assert ft.reserve(2 * CHUNK) is True
        assert self.held(ft, n) == list(range(2, n)), "the two least recently used went"
        assert ft.used_bytes == (n - 2) * CHUNK
        assert ft.reserve(CHUNK) is True  # the reservation counts: one more goes
        assert self.held(ft, n) == list(range(3, n))
        ft.unreserve(3 * CHUNK)
        for i in range(n, n + 3):  # the room is there again: nothing more is evicted
            assert self.put(ft, key(i), payload(i)) is True
        assert self.held(ft, n + 3) == list(range(3, n + 3))

    def test_make_room_frees_regardless_of_capacity(self, tier: Tier[Any]) -> None:
        ft = self.files(tier)
        for i in range(3):
            self.put(ft, key(i), payload(i))
        freed = ft.make_room(CHUNK)
        assert freed == CHUNK
        assert self.held(ft, 3) == [1, 2]
        assert ft.used_bytes == 2 * CHUNK

    # -- file tiers: drops and readers ----------------------------------------------------------------------
    def test_drop_removes_the_chunk(self, tier: Tier[Any]) -> None:
        ft = self.files(tier)
        self.put(ft, key(0), payload(0))
        self.put(ft, key(1), payload(1))
        ft.drop(key(0))
        assert not ft.contains(key(0)) and ft.file_size(key(0)) is None
        assert isinstance(read_chunk(ft, key(0)), Miss)
        assert ft.used_bytes == CHUNK
        ft.drop(key(0))  # again: nothing to do
        ft.drop(key(9))  # never held: nothing to do
        assert ft.used_bytes == CHUNK
        assert self.put(ft, key(0), payload(2)) is True, "after a drop the key is free again"
        self.expect(ft, key(0), payload(2))
        self.expect(ft, key(1), payload(1))

    def test_an_open_descriptor_keeps_its_bytes(self, tier: Tier[Any]) -> None:
        """Opened, then dropped and published again with other bytes: the descriptor reads the first bytes (or
        fails), never the second's."""
        ft = self.files(tier)
        self.put(ft, key(0), payload(0))
        got = ft.open_for_read(key(0))
        assert got is not None
        fd, length = got
        try:
            ft.drop(key(0))
            assert self.put(ft, key(0), payload(1)) is True
            old = read_open(ft, key(0), fd, length)
        finally:
            os.close(fd)
        assert old == payload(0) or (self.read_faults and isinstance(old, Failed)), f"read {old!r:.80}"
        self.expect(ft, key(0), payload(1))

    def test_readers_racing_drops_and_publishes_see_whole_versions(self, tier: Tier[Any]) -> None:
        """One thread drops and publishes the key again, 20 versions; two read it meanwhile: each read is a miss,
        a clean failure (only where faults are injected), or exactly one published version."""
        ft = self.files(tier)
        versions = {payload(100 + v): v for v in range(20)}
        self.put(ft, key(0), payload(100))
        stop = threading.Event()
        seen: list[int] = []
        bad: list[str] = []

        def reader() -> None:
            while not stop.is_set():
                got = read_chunk(ft, key(0))
                if isinstance(got, bytes):
                    if got in versions:
                        seen.append(versions[got])
                    else:
                        bad.append("bytes of no published version")
                elif isinstance(got, Failed) and not self.read_faults:
                    bad.append(got.why)

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for v in range(1, 20):
                ft.drop(key(0))
                # False is possible, rarely: a reader that found the file gone between our drop and our publish
                # forgets the key, and our next drop, meeting that forget in progress, leaves the file to it.
                assert self.put(ft, key(0), payload(100 + v)) in (True, False)
        finally:
            stop.set()
            for t in threads:
                t.join(IO_TIMEOUT_S)
        assert not bad, bad[:5]
        assert seen, "the readers read nothing"
        if ft.contains(key(0)):  # a reader's miss may have unlisted it (a missing file is forgotten)
            for _ in range(40 if self.read_faults else 1):
                got = read_chunk(ft, key(0))
                if isinstance(got, bytes):
                    assert got in versions
                    break
        assert ft.used_bytes == (CHUNK if ft.contains(key(0)) else 0)

    def test_racing_publishers_one_wins(self, tier: Tier[Any]) -> None:
        """Six threads write their own bytes for one key and publish at once: exactly one wins, and its bytes
        are the chunk."""
        ft = self.files(tier)
        self._race([ft] * 6)

    def _race(self, tiers: list[FileTier]) -> None:
        barrier = threading.Barrier(len(tiers))
        results: list[bool | Refused | BaseException | None] = [None] * len(tiers)

        def publisher(j: int) -> None:
            try:
                results[j] = write_chunk(tiers[j], key(0), payload(200 + j), before_publish=barrier)
            except BaseException as exc:  # reported below, with the others' results
                results[j] = exc

        threads = [threading.Thread(target=publisher, args=(j,)) for j in range(len(tiers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(IO_TIMEOUT_S)
        assert [r for r in results if r is not True and r is not False] == [], results
        won = [j for j, r in enumerate(results) if r is True]
        assert len(won) == 1, f"publishers that won: {won}"
        for ft in dict.fromkeys(tiers):
            ft.maybe_refresh(0.0)
            self.expect(ft, key(0), payload(200 + won[0]))
        assert sum(ft.used_bytes for ft in dict.fromkeys(tiers)) >= CHUNK

    def test_racing_nodes_one_wins(self, opener: Callable[..., Tier[Any]]) -> None:
        """Two nodes on one shared tier, three publishers each, one key: exactly one wins everywhere."""
        a = self.files(opener(node="node-a"))
        if not a.capabilities.shared:
            pytest.skip("capability shared=False: no other node publishes to this tier")
        b = self.files(opener(node="node-b"))
        self._race([a, b] * 3)

    def test_other_nodes_publish_is_seen_and_wins(self, opener: Callable[..., Tier[Any]]) -> None:
        a = self.files(opener(node="node-a"))
        if not a.capabilities.shared:
            pytest.skip("capability shared=False: no other node publishes to this tier")
        b = self.files(opener(node="node-b"))
        assert self.put(a, key(0), payload(0)) is True
        b.maybe_refresh(0.0)
        self.expect(b, key(0), payload(0))
        assert self.put(b, key(0), payload(1)) is False
        self.expect(a, key(0), payload(0))
        assert b.used_bytes == 0, "another node's chunk is not counted against this node's quota"

    # -- pins -----------------------------------------------------------------------------------------------
    def test_a_pinned_chunk_is_never_evicted(self, tier: Tier[Any]) -> None:
        ft = self.files(tier, ": no pins")
        if not ft.capabilities.pins:
            pytest.skip("capability pins=False: the tier does not honour pins")
        n = self.capacity_chunks
        self.put(ft, key(0), payload(0))
        ft.pins.add(key(0))
        assert ft.hold(key(0))
        for i in range(1, 2 * n):
            assert self.put(ft, key(i), payload(i)) is True
        self.expect(ft, key(0), payload(0))
        held = self.held(ft, 2 * n)
        for i in held:  # every chunk pinned: a new one is refused, nothing is evicted
            ft.pins.add(key(i))
            ft.hold(key(i))
        assert isinstance(self.put(ft, key(2 * n), payload(2 * n)), Refused)
        assert self.held(ft, 2 * n + 1) == held
        ft.pins.remove(key(held[-1]))
        ft.release(key(held[-1]))
        assert self.put(ft, key(2 * n), payload(2 * n)) is True
        assert self.held(ft, 2 * n + 1) == held[:-1] + [2 * n], "the one chunk released was the victim"
        for i in held[:-1]:
            ft.pins.remove(key(i))

    # -- crashes --------------------------------------------------------------------------------------------
    def _durable(self, tier: Tier[Any]) -> FileTier:
        ft = self.files(tier)
        if not ft.capabilities.durable:
            pytest.skip("capability durable=False: nothing is meant to survive the process")
        return ft

    def test_reopen_without_close_keeps_published_chunks(self, opener: Callable[..., Tier[Any]]) -> None:
        """A crash without ``close``: a second open of the folder (the first never closed) lists what was
        published, with its bytes, and not what was only written to a temporary."""
        first = self._durable(opener())
        self.put(first, key(0), payload(0))
        self.put(first, key(1), payload(1))
        assert not isinstance(write_temp(first, key(2), payload(2)), Refused)
        second = self.files(opener())
        self.expect(second, key(0), payload(0))
        self.expect(second, key(1), payload(1))
        assert not second.contains(key(2))
        assert isinstance(read_chunk(second, key(2)), Miss)

    def test_a_killed_writer_leaves_only_whole_chunks(self, tier_root: Path, opener: Callable[..., Tier[Any]]
                                                     ) -> None:
        """A writer process killed (SIGKILL) after one publish and in the middle of the next: a reopen lists the
        published chunk with its bytes, never the other, and the key can be published again."""
        if not hasattr(os, "fork"):
            pytest.skip("no os.fork here: the writer cannot be killed mid-write")
        self._durable(opener())
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                t = self.files(self.open_tier(tier_root, node="node-a"))
                write_chunk(t, key(0), payload(0))
                write_temp(t, key(1), payload(1))
            finally:
                os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + IO_TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the writer child hung before killing itself")
            time.sleep(0.02)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        again = self.files(opener())
        self.expect(again, key(0), payload(0))
        assert not again.contains(key(1))
        assert isinstance(read_chunk(again, key(1)), Miss)
        assert self.put(again, key(1), payload(3)) is True
        self.expect(again, key(1), payload(3))

    # -- bad input ------------------------------------------------------------------------------------------
    def test_a_file_that_lies_about_its_size_is_not_trusted(self, tier: Tier[Any]) -> None:
        """The chunk's file grown to 64 GiB (sparse) under the tier: the read length stays within the capacity
        and the read fails cleanly; cut to 4 KiB: the read fails cleanly, never returns part of a chunk."""
        ft = self.files(tier, ": no files on disk")
        cap = ft.capacity_bytes
        assert cap is not None
        for i, size in enumerate((1 << 36, 4096)):
            self.put(ft, key(i), payload(i))
            os.truncate(ft.path_for(key(i)), size)
            got = ft.open_for_read(key(i))
            assert got is not None
            fd, length = got
            try:
                assert length <= (cap + 4095) // 4096 * 4096, f"read length {length} B is above the capacity"
                res = read_open(ft, key(i), fd, length)
            finally:
                os.close(fd)
            assert isinstance(res, Failed), f"a {size} B file read as a chunk"

    def test_something_not_a_file_at_a_chunk_path_is_a_miss(self, tier: Tier[Any]) -> None:
        """A FIFO planted at a listed chunk's path: the open neither blocks nor reads it; a miss, and the key
        can be published again."""
        ft = self.files(tier, ": no files on disk")
        self.put(ft, key(0), payload(0))
        path = ft.path_for(key(0))
        os.unlink(path)
        os.mkfifo(path, 0o600)
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(read_chunk(ft, key(0))), daemon=True)
        t.start()
        t.join(IO_TIMEOUT_S)
        if t.is_alive():  # unblock the stuck open (a writer end) before failing
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail("opening a FIFO at a chunk path blocked")
        assert out and isinstance(out[0], Miss), out
        if not ft.contains(key(0)):
            assert self.put(ft, key(0), payload(1)) is True
            self.expect(ft, key(0), payload(1))
