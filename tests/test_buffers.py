"""AlignedBuffer / BufferPool: O_DIRECT alignment, huge-page mappings (and the switch that turns them off),
export-aware reuse and pool accounting."""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstream.io import buffers
from kvstream.io.buffers import ALIGN, HUGE_PAGE, AlignedBuffer, BufferPool

MiB = 1 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """``always`` / ``madvise`` / ``never`` (the bracketed word), or None without THP."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


needs_thp = pytest.mark.skipif(_thp_mode() is None or not hasattr(mmap, "MADV_HUGEPAGE"),
                               reason="no transparent huge page support here")


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                if entry is not None:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                if lo <= address < hi:
                    entry = {"range": head}
            elif entry is not None:
                key, _, val = line.partition(":")
                entry[key] = val.strip()
    assert entry is not None, f"no mapping holds {address:#x}"
    return entry


def _vmflags(buf: AlignedBuffer) -> list[str]:
    return _smaps_entry(buf.address)["VmFlags"].split()


def _anon_huge_kib(buf: AlignedBuffer) -> int:
    return int(_smaps_entry(buf.address)["AnonHugePages"].split()[0])


def _touch(buf: AlignedBuffer) -> None:
    ctypes.memset(buf.address, 0x5A, buf.capacity)


# ── alignment ──────────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("capacity", [ALIGN, 8 * ALIGN, 256 << 10, 320 << 10, 2 * MiB - ALIGN])
@pytest.mark.parametrize("hugepages", [True, False])
def test_small_buffers_are_page_aligned_and_not_huge(capacity: int, hugepages: bool) -> None:
    bufs = [AlignedBuffer(capacity, hugepages=hugepages) for _ in range(4)]
    for b in bufs:
        assert b.address % ALIGN == 0
        assert len(b) == b.capacity == capacity == len(b.view())
        assert b.hugepages is False  # below one huge page there is nothing to ask for


@needs_thp
@pytest.mark.parametrize("capacity", [HUGE_PAGE, 4 * MiB + ALIGN, 5 * MiB, 7 * MiB + 2 * ALIGN, 8 * MiB])
def test_large_buffers_start_on_a_huge_page_boundary(capacity: int) -> None:
    bufs = [AlignedBuffer(capacity, hugepages=True) for _ in range(4)]
    for b in bufs:
        assert b.hugepages is True
        assert b.address % HUGE_PAGE == 0, f"{b!r} is not {HUGE_PAGE}-aligned"
        assert len(b.view()) == capacity
        # trimmed: nothing of the mapping reaches past the buffer, so no huge page can either
        assert len(b._mm) == b._off + capacity


@pytest.mark.parametrize("capacity", [HUGE_PAGE, 5 * MiB])
def test_large_buffers_without_hugepages_are_plain_page_aligned(capacity: int) -> None:
    b = AlignedBuffer(capacity, hugepages=False)
    assert b.address % ALIGN == 0 and b.hugepages is False
    assert len(b._mm) == capacity and b._off == 0


def test_capacity_must_be_a_positive_multiple_of_align() -> None:
    for bad in (0, -ALIGN, 100, ALIGN + 1, 3 * MiB + 1):
        with pytest.raises(ValueError):
            AlignedBuffer(bad)


def test_overmap_fallback_finds_a_boundary_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 1 GiB "huge page" is almost never where the kernel puts a mapping: exercises over-map + offset + trim.
    monkeypatch.setattr(buffers, "HUGE_PAGE", 1 << 30)
    mm, off, _ = buffers._map_huge(8 * MiB)
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert (base + off) % (1 << 30) == 0
        assert len(mm) == off + 8 * MiB  # the tail is trimmed
    finally:
        gc.collect()
        mm.close()


# ── views at an offset inside the mapping (the over-map path) ──────────────────────────────────────────────


def test_views_address_and_exports_at_an_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    off = 3 * ALIGN
    monkeypatch.setattr(buffers, "_map_huge", lambda cap: (buffers._anon(cap + off + 5 * ALIGN), off, False))
    b = AlignedBuffer(HUGE_PAGE, hugepages=True)
    assert b._off == off and not b._whole
    assert len(b.view()) == HUGE_PAGE and len(b.readonly()) == HUGE_PAGE
    v = b.view()
    v[:4] = b"head"
    v[-4:] = b"tail"
    assert ctypes.string_at(b.address, 4) == b"head"
    assert ctypes.string_at(b.address + HUGE_PAGE - 4, 4) == b"tail"
    assert bytes(b.view(-4)) == b"tail" and bytes(b.readonly(0, 4)) == b"head"
    assert bytes(b._mm[:off]) == bytes(off)  # nothing written before the buffer
    with pytest.raises(TypeError):
        b.readonly()[0] = 1
    assert b.exported()
    del v
    assert not b.exported()
    r = b.readonly(10, 20)
    assert b.exported()
    del r
    assert not b.exported()


@pytest.mark.parametrize("hugepages", [True, False])
def test_view_writes_land_at_address(hugepages: bool) -> None:
    b = AlignedBuffer(5 * MiB, hugepages=hugepages)
    data = np.random.default_rng(1).bytes(5 * MiB)
    b.view()[:] = data
    assert ctypes.string_at(b.address, 5 * MiB) == data
    assert bytes(b.view(MiB, MiB + 16)) == data[MiB:MiB + 16]
    assert not b.exported()


# ── the switch ─────────────────────────────────────────────────────────────────────────────────────────────


@needs_thp
def test_madvise_sets_the_hugepage_flag_only_when_asked() -> None:
    on = AlignedBuffer(8 * MiB, hugepages=True)
    off = AlignedBuffer(8 * MiB, hugepages=False)
    assert "hg" in _vmflags(on)  # VM_HUGEPAGE: madvise(MADV_HUGEPAGE) reached the kernel
    assert "hg" not in _vmflags(off)


@needs_thp
def test_module_default_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers, "HUGEPAGES", False)
    b = AlignedBuffer(8 * MiB)
    assert not b.hugepages and "hg" not in _vmflags(b)
    pb = BufferPool(64 * MiB).acquire(8 * MiB)
    assert pb is not None and not pb.hugepages and "hg" not in _vmflags(pb)
    monkeypatch.setattr(buffers, "HUGEPAGES", True)
    b = AlignedBuffer(8 * MiB)
    assert b.hugepages and "hg" in _vmflags(b) and b.address % HUGE_PAGE == 0
    pb = BufferPool(64 * MiB).acquire(8 * MiB)
    assert pb is not None and pb.hugepages and "hg" in _vmflags(pb)
    # an explicit pool setting beats the module default
    pb = BufferPool(64 * MiB, hugepages=False).acquire(8 * MiB)
    assert pb is not None and not pb.hugepages


_PROBE = """
import json
from kvstream.io import buffers
b = buffers.AlignedBuffer(8 << 20)
print(json.dumps({"default": buffers.HUGEPAGES, "buffer": b.hugepages}))
"""


@needs_thp
@pytest.mark.parametrize("value,expect", [(None, True), ("1", True), ("0", False), ("off", False), ("false", False)])
def test_environment_switch(value: str | None, expect: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTREAM_HUGEPAGES"}
    if value is not None:
        env["KVSTREAM_HUGEPAGES"] = value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"default": expect, "buffer": expect}


@needs_thp
@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="THP is off here")
def test_touched_buffer_is_backed_by_huge_pages() -> None:
    # The effect itself: after the first touch the kernel backed the madvised buffer with huge pages. With
    # defrag "madvise" (the default) the fault compacts memory if it must, so only real memory exhaustion fails.
    b = AlignedBuffer(8 * MiB, hugepages=True)
    _touch(b)
    assert _anon_huge_kib(b) >= HUGE_PAGE // 1024
    if _thp_mode() == "madvise":  # nothing gets huge pages without asking
        plain = AlignedBuffer(8 * MiB, hugepages=False)
        _touch(plain)
        assert _anon_huge_kib(plain) == 0


@needs_thp
@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="THP is off here")
def test_partial_huge_page_is_not_rounded_up() -> None:
    # 4 MiB + 4 KiB (a 4 MiB chunk with its header): two huge pages and one small page, never a third huge page.
    b = AlignedBuffer(4 * MiB + ALIGN, hugepages=True)
    _touch(b)
    e = _smaps_entry(b.address)
    lo, hi = (int(x, 16) for x in e["range"].split("-"))
    if lo == b.address and hi == b.address + b.capacity:  # the mapping was not merged with a neighbour
        assert int(e["AnonHugePages"].split()[0]) == 4096
        assert int(e["Rss"].split()[0]) == 4096 + 4


# ── the pool ───────────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("size", [64 << 10, 4 * MiB + ALIGN])
def test_pool_never_hands_out_an_exported_buffer(size: int) -> None:
    pool = BufferPool(64 * MiB)
    a = pool.acquire(size)
    assert a is not None
    view = a.view()
    arr = np.frombuffer(a.readonly(), dtype=np.uint8)  # a numpy array over it is an export too
    pool.release(a)
    b = pool.acquire(size)
    assert b is not None and b is not a, "a buffer with a live view was handed out again"
    assert pool.allocations == 2 and pool.reuses == 0
    del view
    pool.release(b)
    c = pool.acquire(size)
    assert c is b  # b had no views: reused
    assert pool.reuses == 1
    d = pool.acquire(size)
    assert d is not a  # a still has the numpy array
    assert pool.allocations == 3
    del arr
    pool.release(c)
    pool.release(d)
    got = {id(pool.acquire(size)) for _ in range(3)}
    assert id(a) in got, "a is reusable once its last export is gone"
    assert pool.allocations == 3


def test_pool_accounting_with_large_buffers() -> None:
    cls = BufferPool.size_class(4 * MiB + ALIGN)
    assert cls == 5 * MiB
    pool = BufferPool(3 * cls)
    bufs = [pool.acquire(4 * MiB + ALIGN) for _ in range(3)]
    assert all(b is not None and b.capacity == cls for b in bufs)
    assert pool.acquire(4 * MiB + ALIGN) is None  # a shortage is a return value
    assert pool.in_use_bytes == pool.allocated_bytes == 3 * cls
    for b in bufs:
        assert b is not None
        pool.release(b)
    assert pool.in_use_bytes == 0 and pool.allocated_bytes == 3 * cls
    # another size class forces the pool to drop free buffers to stay within its capacity
    big = pool.acquire(12 * MiB)
    assert big is not None and big.capacity == 12 * MiB
    assert pool.allocated_bytes <= pool.capacity_bytes
    assert pool.in_use_bytes == 12 * MiB
    pool.release(big)
    assert pool.in_use_bytes == 0


def test_pool_rejects_tiny_capacity() -> None:
    with pytest.raises(ValueError):
        BufferPool(ALIGN - 1)
