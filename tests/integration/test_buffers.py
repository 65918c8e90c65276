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


# ── huge-page slabs for small size classes ─────────────────────────────────────────────────────────────────

CHUNK_1M = MiB + ALIGN  # a 1 MiB chunk and its 4 KiB header: size class 1.25 MiB


def _span(buf: AlignedBuffer) -> tuple[int, int]:
    return buf.address, buf.address + buf.capacity


def test_slab_sizes_waste_little() -> None:
    assert buffers._slab_bytes(BufferPool.size_class(CHUNK_1M)) == 5 * HUGE_PAGE  # 8 slots of 1.25 MiB
    assert buffers._slab_bytes(64 << 10) == HUGE_PAGE
    assert buffers._slab_bytes(BufferPool.size_class(CHUNK_1M), limit=4 * MiB) == 2 * HUGE_PAGE
    assert buffers._slab_bytes(BufferPool.size_class(CHUNK_1M), limit=HUGE_PAGE - ALIGN) == 0
    for cls in range(buffers.SLAB_MIN, HUGE_PAGE, 12 * ALIGN):
        size = buffers._slab_bytes(cls)
        assert size % HUGE_PAGE == 0 and size // cls >= 1 and size % cls <= size // 8


@needs_thp
@pytest.mark.parametrize("n", [64 << 10, 100 << 10, CHUNK_1M, 3 * MiB // 2 + ALIGN])
def test_small_pool_buffers_are_distinct_aligned_slices_of_one_slab(n: int) -> None:
    pool = BufferPool(256 * MiB, hugepages=True)
    cls = BufferPool.size_class(n)
    first = pool.acquire(n)
    assert first is not None and first._slab is not None
    slab = first._slab
    bufs = [first] + [pool.acquire(n) for _ in range(slab.nslots - 1)]
    assert all(b is not None and b._slab is slab for b in bufs), "one slab serves its class until it is full"
    assert pool.slab_count == 1 and pool.allocations == slab.nslots and pool.reuses == 0
    slab_lo = ctypes.addressof(ctypes.c_char.from_buffer(slab.mm)) + slab.base
    assert slab_lo % HUGE_PAGE == 0 and slab.size % HUGE_PAGE == 0
    spans = sorted(_span(b) for b in bufs)
    assert len({lo for lo, _ in spans}) == len(bufs)
    for (lo, hi), b in zip(spans, bufs):
        assert lo % ALIGN == 0 and hi - lo == cls == b.capacity == len(b.view())
        assert slab_lo <= lo and hi <= slab_lo + slab.size
    for (_, hi), (lo, _) in zip(spans, spans[1:]):
        assert hi <= lo, "slots overlap"
    # each view writes its own slot and nothing else
    for i, b in enumerate(bufs):
        b.view()[:] = bytes([i + 1]) * cls
    for i, b in enumerate(bufs):
        assert ctypes.string_at(b.address, cls) == bytes([i + 1]) * cls
        assert bytes(b.readonly(cls - 3)) == bytes([i + 1]) * 3
    nxt = pool.acquire(n)  # the slab is full: a second one
    assert nxt is not None and nxt._slab is not slab and pool.slab_count == 2


@needs_thp
def test_slab_mapping_is_madvised_and_huge() -> None:
    pool = BufferPool(64 * MiB, hugepages=True)
    bufs = [pool.acquire(CHUNK_1M) for _ in range(8)]
    for b in bufs:
        assert b is not None and b._slab is not None and b.hugepages
        assert "hg" in _vmflags(b)  # VM_HUGEPAGE on the slab's mapping
    if _thp_mode() in ("always", "madvise"):
        for b in bufs:
            _touch(b)
        assert _anon_huge_kib(bufs[0]) >= HUGE_PAGE // 1024
    plain = BufferPool(64 * MiB, hugepages=False).acquire(CHUNK_1M)
    assert plain is not None and plain._slab is None and not plain.hugepages
    assert "hg" not in _vmflags(plain)


def slab_buffer(pool: BufferPool) -> AlignedBuffer:
    """A 1 MiB-chunk buffer from ``pool``, carved from a huge-page slab (skips where THP cannot be asked for)."""
    a = pool.acquire(CHUNK_1M)
    assert a is not None
    if a._slab is None:
        pytest.skip("no slabs here (no MADV_HUGEPAGE)")
    return a


def test_slot_exports_are_per_buffer() -> None:
    pool = BufferPool(64 * MiB, hugepages=True)
    a, b = pool.acquire(CHUNK_1M), pool.acquire(CHUNK_1M)
    assert a is not None and b is not None
    if a._slab is None:
        pytest.skip("no slabs here (no MADV_HUGEPAGE)")
    assert a._slab is b._slab and not a.exported() and not b.exported()
    v = a.view(10, 20)
    assert a.exported() and not b.exported(), "a view of one slot must not mark its neighbours"
    arr = np.frombuffer(b.readonly(), dtype=np.uint8)
    assert b.exported()
    del v
    assert not a.exported() and b.exported()
    del arr
    assert not b.exported()


def test_exported_slot_is_not_handed_out_again() -> None:
    pool = BufferPool(64 * MiB, hugepages=True)
    a = slab_buffer(pool)
    nslots = a._slab.nslots
    view = a.view()
    arr = np.frombuffer(a.readonly(), dtype=np.uint8)
    pool.release(a)
    others = [pool.acquire(CHUNK_1M) for _ in range(2 * nslots)]
    assert all(o is not None and o is not a for o in others), "a slot with live views was handed out again"
    for o in others:
        assert o is not None
        pool.release(o)
    got = [pool.acquire(CHUNK_1M) for _ in range(2 * nslots - 1)]
    assert all(g is not a for g in got)
    del view
    x = pool.acquire(CHUNK_1M)  # a is still parked: the numpy array exports it
    assert x is not None and x is not a
    pool.release(x)
    del arr
    for g in got:
        assert g is not None
        pool.release(g)
    again = {id(pool.acquire(CHUNK_1M)) for _ in range(2 * nslots)}
    assert id(a) in again, "a is reusable once its last export is gone"


def test_slab_pool_accounting_and_capacity() -> None:
    cls = BufferPool.size_class(CHUNK_1M)
    pool = BufferPool(12 * MiB, hugepages=True)
    a = slab_buffer(pool)
    assert pool.allocated_bytes == 10 * MiB and pool.in_use_bytes == cls  # the whole slab counts at once
    bufs = [a] + [pool.acquire(CHUNK_1M) for _ in range(7)]
    assert all(b is not None for b in bufs)
    assert pool.allocated_bytes == 10 * MiB and pool.in_use_bytes == 8 * cls and pool.slab_count == 1
    ninth = pool.acquire(CHUNK_1M)  # 2 MiB of room left: a one-huge-page slab with one slot
    assert ninth is not None and ninth._slab is not None and ninth._slab.size == HUGE_PAGE
    assert pool.allocated_bytes == 12 * MiB == pool.capacity_bytes
    assert pool.acquire(CHUNK_1M) is None and pool.acquire(64 << 10) is None
    assert pool.allocated_bytes <= pool.capacity_bytes
    # a slab with a slot in use is never dropped: the big buffer does not fit
    for b in bufs[1:]:
        assert b is not None
        pool.release(b)
    pool.release(ninth)
    assert pool.in_use_bytes == cls
    assert pool.acquire(4 * MiB) is None  # only the 2 MiB slab could go; 4 MiB still does not fit
    assert pool.slab_count == 1 and pool.allocated_bytes == 10 * MiB  # it went; the busy one stayed
    # a wholly free but exported slab stays mapped too
    v = bufs[1].view()
    pool.release(a)
    assert pool.acquire(4 * MiB) is None and pool.allocated_bytes == 10 * MiB
    del v
    big = pool.acquire(4 * MiB)
    assert big is not None and big._slab is None
    assert pool.slab_count == 0 and pool.allocated_bytes == 4 * MiB and pool.in_use_bytes == 4 * MiB
    pool.release(big)
    assert pool.in_use_bytes == 0


def test_dropped_slab_is_unmapped() -> None:
    pool = BufferPool(10 * MiB, hugepages=True)
    a = slab_buffer(pool)
    addr = a.address
    pool.release(a)
    del a
    big = pool.acquire(8 * MiB)
    assert big is not None and pool.slab_count == 0
    del big
    gc.collect()
    with pytest.raises(AssertionError):
        _smaps_entry(addr)  # no mapping holds the old slot (unless something new landed there)


@pytest.mark.parametrize("how", ["pool", "module"])
def test_no_slabs_without_hugepages(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    if how == "module":
        monkeypatch.setattr(buffers, "HUGEPAGES", False)
        pool = BufferPool(64 * MiB)
    else:
        pool = BufferPool(64 * MiB, hugepages=False)
    cls = BufferPool.size_class(CHUNK_1M)
    bufs = [pool.acquire(CHUNK_1M) for _ in range(3)]
    assert all(b is not None and b._slab is None and b._exp is None and len(b._mm) == cls for b in bufs)
    assert pool.slab_count == 0 and pool.allocated_bytes == 3 * cls == pool.in_use_bytes


@pytest.mark.parametrize("size", [3 * MiB, 100 * 1024])  # a plain buffer class and a slab class
def test_prefault_fills_the_pool_with_touched_free_buffers(size: int) -> None:
    """``prefault`` maps the pool's free room in one size class, every page resident, and leaves the buffers
    free: later acquires reuse them and allocate nothing."""
    pool = BufferPool(16 * MiB)
    done = pool.prefault(size)
    cls = BufferPool.size_class(size)
    assert 16 * MiB - cls - 2 * MiB < done <= 16 * MiB == pool.capacity_bytes
    assert done <= pool.allocated_bytes <= pool.capacity_bytes and pool.in_use_bytes == 0  # slabs count whole
    allocations = pool.allocations
    bufs = [pool.acquire(size) for _ in range(done // cls)]
    assert all(b is not None for b in bufs)
    assert pool.allocations == allocations and pool.reuses >= len(bufs)
    for b in bufs:
        assert b is not None
        assert _resident_kib(b.address) >= b.capacity // 1024


def _resident_kib(address: int) -> int:
    """Resident KiB of the mapping holding ``address`` (smaps ``Rss``): pages touched, not merely mapped."""
    return int(_smaps_entry(address)["Rss"].split()[0])
