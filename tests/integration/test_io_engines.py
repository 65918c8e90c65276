"""Both I/O engines against the ring contract of :mod:`kvstream.io.engine`, on real files with O_DIRECT.

Files live on a real disk: on tmpfs (often /tmp, always /dev/shm) O_DIRECT is refused, or (Linux >= 6.6)
accepted but served from RAM without its alignment rules. So the fixture picks the first of pytest's tmp_path
and /var/tmp where O_DIRECT reaches a device, and only then falls back to buffered I/O in tmp_path (with a
warning). On the project VM that is tmp_path (/tmp is ext4 on the root disk). The uring cases are skipped only when ``unavailable_reason()`` gives a
reason, which is then the skip message; set KVSTREAM_REQUIRE_URING=1 to turn that skip into a failure.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstream.errors import StoreClosedError
from kvstream.io import make_engine, available_engines
from kvstream.io import uring
from kvstream.io.buffers import AlignedBuffer
from kvstream.io.engine import IOOp, OpKind, Ring
from kvstream.io.rawread import direct_io_problem

ENGINES = ["threads", "uring"]
KiB = 1024


def _require_uring() -> None:
    reason = uring.unavailable_reason()
    if reason is not None:
        if os.environ.get("KVSTREAM_REQUIRE_URING"):
            pytest.fail(f"io_uring required (KVSTREAM_REQUIRE_URING) but unavailable: {reason}")
        pytest.skip(f"io_uring unavailable: {reason}")


@pytest.fixture(params=ENGINES)
def engine_name(request: pytest.FixtureRequest) -> str:
    if request.param == "uring":
        _require_uring()
    return request.param


@pytest.fixture
def make_ring(engine_name: str) -> Iterator[Callable[..., Ring]]:
    """Rings of the parametrised engine; each is closed at the end of the test."""
    rings: list[Ring] = []
    engine = make_engine(engine_name)

    def make(label: str = "t", **kw: int) -> Ring:
        ring = engine.ring(label, **kw)
        rings.append(ring)
        return ring

    yield make
    for ring in rings:
        ring.close()


def _direct_ok(directory: Path) -> bool:
    # Not just "does an O_DIRECT open succeed": tmpfs accepts one since Linux 6.6 and still serves RAM,
    # without O_DIRECT's alignment rules.
    return direct_io_problem(directory) is None


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """``(directory, extra open flags)``: O_DIRECT on a real disk where one can be found."""
    if _direct_ok(tmp_path):
        yield tmp_path, os.O_DIRECT
        return
    if os.path.isdir("/var/tmp"):
        d = Path(tempfile.mkdtemp(prefix="kvstream-test-io-", dir="/var/tmp"))
        try:
            if _direct_ok(d):
                yield d, os.O_DIRECT
                return
        finally:
            shutil.rmtree(d, ignore_errors=True)
    warnings.warn(f"no O_DIRECT-capable directory (tried {tmp_path}, /var/tmp): testing buffered I/O only")
    yield tmp_path, 0


def _open(disk: tuple[Path, int], name: str, data: bytes | None = None, *, write: bool = False) -> int:
    """Open ``name`` in the test directory (O_DIRECT if available), first writing ``data`` to it if given."""
    directory, extra = disk
    path = directory / name
    if data is not None:
        path.write_bytes(data)
    return os.open(path, (os.O_RDWR | os.O_CREAT if write else os.O_RDONLY) | extra, 0o600)


def _buf(data: bytes = b"", capacity: int | None = None) -> AlignedBuffer:
    buf = AlignedBuffer(capacity or max(4096, -(-len(data) // 4096) * 4096))
    if data:
        buf.view(0, len(data))[:] = data
    return buf


class Recorder:
    """Callbacks that count their calls per op, and wake a waiter when ``expected`` ops are done."""

    def __init__(self, expected: int) -> None:
        self.calls: dict[int, int] = {}
        self.results: dict[int, int] = {}
        self.threads: set[str] = set()
        self.expected = expected
        self._lock = threading.Lock()
        self.done = threading.Event()

    def __call__(self, op: IOOp) -> None:
        with self._lock:
            self.calls[id(op)] = self.calls.get(id(op), 0) + 1
            self.results[id(op)] = op.result
            self.threads.add(threading.current_thread().name)
            if sum(self.calls.values()) >= self.expected:
                self.done.set()


def _run(ring: Ring, ops: list[IOOp], timeout: float = 20.0) -> list[int]:
    ring.submit(ops)
    assert ring.drain(timeout), f"ring did not drain in {timeout}s; {ring.inflight()} in flight"
    return [op.result for op in ops]


def _op(kind: OpKind, fd: int, buf: AlignedBuffer, length: int, offset: int, cb: Callable[[IOOp], None], buf_offset: int = 0) -> IOOp:
    return IOOp(kind=kind, fd=fd, buf=buf, length=length, offset=offset, callback=cb, buf_offset=buf_offset)


def _noop(op: IOOp) -> None:
    pass


# ── data ───────────────────────────────────────────────────────────────────────────────────────────────────


def test_write_then_read_back_random_data(make_ring: Callable[..., Ring], disk: tuple[Path, int]) -> None:
    rng = random.Random(7)
    sizes = [4 * KiB, 64 * KiB, 1024 * KiB, 12 * KiB, 256 * KiB]
    blobs = [rng.randbytes(n) for n in sizes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    wfd = _open(disk, "data.bin", write=True)
    try:
        ring_w, ring_r = make_ring("w", depth=3), make_ring("r", depth=3)
        wbufs = [_buf(b) for b in blobs]
        writes = [_op(OpKind.WRITE, wfd, b, len(d), off, _noop) for b, d, off in zip(wbufs, blobs, offsets)]
        assert _run(ring_w, writes) == sizes
        os.fsync(wfd)
        rbufs = [_buf(capacity=len(b) + 4096) for b in blobs]
        # read into the second page of each buffer: buf_offset is honoured
        reads = [_op(OpKind.READ, wfd, b, len(d), off, _noop, buf_offset=4096) for b, d, off in zip(rbufs, blobs, offsets)]
        assert _run(ring_r, reads) == sizes
        for b, d in zip(rbufs, blobs):
            assert bytes(b.view(4096, 4096 + len(d))) == d
    finally:
        os.close(wfd)


def test_both_engines_read_identical_bytes(disk: tuple[Path, int]) -> None:
    _require_uring()
    data = random.Random(11).randbytes(512 * KiB)
    fd = _open(disk, "same.bin", data)
    got: dict[str, bytes] = {}
    try:
        for name in ENGINES:
            ring = make_engine(name).ring(name, depth=4)
            ops = [_op(OpKind.READ, fd, _buf(capacity=64 * KiB), 64 * KiB, i * 64 * KiB, _noop) for i in range(8)]
            assert _run(ring, ops[::-1]) == [64 * KiB] * 8  # submitted back to front
            ring.close()
            got[name] = b"".join(bytes(op.buf.view()) for op in ops)
    finally:
        os.close(fd)
    assert got["threads"] == got["uring"] == data


def test_short_read_at_eof_reports_true_length(make_ring: Callable[..., Ring], disk: tuple[Path, int]) -> None:
    data = random.Random(3).randbytes(12 * KiB)  # aligned size: the O_DIRECT continuation meets a clean EOF
    fd = _open(disk, "eof.bin", data)
    try:
        ring = make_ring()
        buf, past = _buf(capacity=16 * KiB), _buf(capacity=8 * KiB)
        ops = [_op(OpKind.READ, fd, buf, 16 * KiB, 8 * KiB, _noop), _op(OpKind.READ, fd, past, 8 * KiB, 64 * KiB, _noop)]
        assert _run(ring, ops) == [4 * KiB, 0]
        assert bytes(buf.view(0, 4 * KiB)) == data[8 * KiB :]
    finally:
        os.close(fd)


def test_short_read_unaligned_eof_buffered(make_ring: Callable[..., Ring], tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"x" * 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = _buf(capacity=8 * KiB)
        assert _run(make_ring(), [_op(OpKind.READ, fd, buf, 8 * KiB, 0, _noop)]) == [5000]
        assert bytes(buf.view(0, 5000)) == b"x" * 5000
    finally:
        os.close(fd)


# ── errors ─────────────────────────────────────────────────────────────────────────────────────────────────


def _closed_fd(tmp_path: Path) -> int:
    fd = os.open(tmp_path / "gone", os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    fd = 1_000_000 + fd  # far above anything open, so no other test thread can reuse it meanwhile
    with pytest.raises(OSError):
        os.fstat(fd)
    return fd


def test_bad_fd_is_an_errno_result_not_an_exception(make_ring: Callable[..., Ring], tmp_path: Path) -> None:
    rec = Recorder(2)
    fd = _closed_fd(tmp_path)
    ops = [_op(OpKind.READ, fd, _buf(capacity=4096), 4096, 0, rec), _op(OpKind.WRITE, fd, _buf(b"a" * 4096), 4096, 0, rec)]
    assert _run(make_ring(), ops) == [-errno.EBADF, -errno.EBADF]
    assert list(rec.calls.values()) == [1, 1]


def test_errno_results_match_between_engines(disk: tuple[Path, int]) -> None:
    _require_uring()
    directory, extra = disk
    fd = _open(disk, "err.bin", b"z" * 8192)
    try:
        results = {}
        for name in ENGINES:
            ring = make_engine(name).ring(name)
            ops = [
                _op(OpKind.WRITE, fd, _buf(b"a" * 4096), 4096, 0, _noop),  # fd opened read-only
                _op(OpKind.READ, fd, _buf(capacity=8192), 4096, 0, _noop, buf_offset=1),  # misaligned for O_DIRECT
            ]
            results[name] = _run(ring, ops)
            ring.close()
    finally:
        os.close(fd)
    assert results["threads"] == results["uring"]
    assert results["uring"][0] == -errno.EBADF
    assert results["uring"][1] == (-errno.EINVAL if extra else 4096)


# ── volume, limits, lifecycle ──────────────────────────────────────────────────────────────────────────────


def test_thousand_small_ops_each_callback_exactly_once(make_ring: Callable[..., Ring], disk: tuple[Path, int]) -> None:
    data = random.Random(5).randbytes(256 * KiB)
    fd = _open(disk, "small.bin", data)
    try:
        ring = make_ring(depth=16)
        rec = Recorder(1000)
        bufs = [_buf(capacity=4096) for _ in range(1000)]
        ops = [_op(OpKind.READ, fd, b, 4096, (i % 64) * 4096, rec) for i, b in enumerate(bufs)]
        for k in range(0, 1000, 100):  # several submit batches, as a store would
            ring.submit(ops[k : k + 100])
        assert rec.done.wait(30) and ring.drain(5)
        assert len(rec.calls) == 1000 and set(rec.calls.values()) == {1}
        assert all(op.result == 4096 for op in ops)
        assert all(bytes(op.buf.view()) == data[op.offset : op.offset + 4096] for op in ops[:: 37])
        assert all(op.completed_at >= op.submitted_at > 0 for op in ops)
        assert ring.inflight() == 0
    finally:
        os.close(fd)


def _record_peaks(ring: Ring) -> list[tuple[int, int]]:
    """Wrap the ring's admission bookkeeping (both engines use ``_limits``) to record (ops, bytes) active."""
    limits = ring._limits  # type: ignore[attr-defined]
    peaks: list[tuple[int, int]] = []
    start = limits.start

    def recording_start(op: IOOp) -> None:
        start(op)
        peaks.append((limits.active_ops, limits.active_bytes))

    limits.start = recording_start
    return peaks


@pytest.mark.parametrize("depth,max_bytes,op_kib,n", [(4, 1 << 30, 16, 64), (64, 48 * KiB, 16, 64), (8, 8 * KiB, 64, 6)])
def test_depth_and_max_bytes_limits(make_ring: Callable[..., Ring], disk: tuple[Path, int], depth: int, max_bytes: int, op_kib: int, n: int) -> None:
    fd = _open(disk, "lim.bin", bytes(1024 * KiB))
    try:
        ring = make_ring(depth=depth, max_bytes=max_bytes)
        peaks = _record_peaks(ring)
        ops = [_op(OpKind.READ, fd, _buf(capacity=op_kib * KiB), op_kib * KiB, (i % 16) * op_kib * KiB, _noop) for i in range(n)]
        assert _run(ring, ops) == [op_kib * KiB] * n
        max_ops = max(p[0] for p in peaks)
        max_b = max(p[1] for p in peaks)
        op_bytes = op_kib * KiB
        assert len(peaks) == n
        assert max_ops <= depth
        # at least one op always fits, even one larger than max_bytes
        assert max_b <= max(max_bytes, op_bytes)
        assert max_ops == min(depth, max(1, max_bytes // op_bytes))  # all submitted at once: the limit is reached
    finally:
        os.close(fd)


def test_close_waits_for_inflight_ops(make_ring: Callable[..., Ring], disk: tuple[Path, int]) -> None:
    fd = _open(disk, "close.bin", bytes(256 * KiB))
    try:
        ring = make_ring(depth=2)
        finished: list[int] = []

        def slow(op: IOOp) -> None:
            time.sleep(0.002)
            finished.append(op.result)

        ops = [_op(OpKind.READ, fd, _buf(capacity=64 * KiB), 64 * KiB, (i % 4) * 64 * KiB, slow) for i in range(50)]
        ring.submit(ops)
        ring.close()
        assert len(finished) == 50 and set(finished) == {64 * KiB}
        assert ring.inflight() == 0
        ring.close()  # idempotent
    finally:
        os.close(fd)


def test_submit_after_close_raises(make_ring: Callable[..., Ring], tmp_path: Path) -> None:
    ring = make_ring()
    ring.close()
    with pytest.raises(StoreClosedError, match="closed"):
        ring.submit([_op(OpKind.READ, 0, _buf(capacity=4096), 4096, 0, _noop)])


def test_close_from_a_callback_does_not_deadlock(make_ring: Callable[..., Ring], disk: tuple[Path, int]) -> None:
    """close() from the ring's own callback must return without waiting (the ops left need that very callback
    to return first), and the ring still completes them."""
    fd = _open(disk, "cb.bin", bytes(64 * KiB))
    try:
        ring = make_ring(depth=2)
        rec = Recorder(8)

        def closing(op: IOOp) -> None:
            rec(op)
            ring.close()

        ops = [_op(OpKind.READ, fd, _buf(capacity=8 * KiB), 8 * KiB, i * 8 * KiB, closing) for i in range(8)]
        ring.submit(ops)
        assert rec.done.wait(10)
        assert ring.drain(5)
        assert set(rec.calls.values()) == {1}
        with pytest.raises(StoreClosedError):
            ring.submit(ops[:1])
    finally:
        os.close(fd)


def test_a_raising_callback_does_not_stop_the_ring(
    make_ring: Callable[..., Ring], disk: tuple[Path, int], caplog: pytest.LogCaptureFixture
) -> None:
    """A callback that raises is logged and the ring goes on: with depth 1 (one worker thread for the thread
    engine) every later op still completes."""
    fd = _open(disk, "raise-any.bin", bytes(16 * KiB))
    try:
        ring = make_ring("raiser", depth=1)
        raised = threading.Event()

        def bad(op: IOOp) -> None:
            raised.set()
            raise RuntimeError("callback bug")

        first = _op(OpKind.READ, fd, _buf(capacity=4096), 4096, 0, bad)
        ring.submit([first])
        assert raised.wait(10) and ring.drain(10)
        rec = Recorder(4)
        later = [_op(OpKind.READ, fd, _buf(capacity=4096), 4096, i * 4096, rec) for i in range(4)]
        assert _run(ring, later, timeout=5) == [4096] * 4
        assert len(rec.calls) == 4 and set(rec.calls.values()) == {1}
        assert first.result == 4096
        assert "callback bug" in caplog.text and "'raiser'" in caplog.text
    finally:
        os.close(fd)


class _CountOnlyRing(Ring):
    """A ring with only what the ABC requires, so that ``drain`` is the base class's."""

    def __init__(self, inflight: int) -> None:
        self.n = inflight

    def submit(self, ops: object) -> None:
        raise NotImplementedError

    def inflight(self) -> int:
        return self.n

    def close(self) -> None:
        pass


def test_base_ring_drain_works_from_inflight_alone() -> None:
    idle = _CountOnlyRing(0)
    assert idle.drain() and idle.drain(0)
    busy = _CountOnlyRing(2)
    t0 = time.monotonic()
    assert not busy.drain(0) and not busy.drain(0.05)
    assert 0.05 <= time.monotonic() - t0 < 2
    for timeout in (5.0, None):
        busy.n = 2
        timer = threading.Timer(0.05, lambda: setattr(busy, "n", 0))
        timer.start()
        t0 = time.monotonic()
        assert busy.drain(timeout)
        assert 0.04 <= time.monotonic() - t0 < 2  # waited for it, and noticed soon after
        timer.join()


def test_submit_from_many_short_lived_threads(make_ring: Callable[..., Ring], disk: tuple[Path, int]) -> None:
    """Threads that submit and exit at once: their ops must still complete (io-wq work is not theirs)."""
    directory, _ = disk
    fd = _open(disk, "mt.bin", write=True)
    try:
        ring = make_ring(depth=8)
        rec = Recorder(8 * 25)
        ops = [_op(OpKind.WRITE, fd, _buf(bytes([i % 251]) * 4096), 4096, i * 4096, rec) for i in range(200)]  # extending writes
        threads = [threading.Thread(target=ring.submit, args=(ops[t * 25 : (t + 1) * 25],)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert rec.done.wait(30) and ring.drain(5)
        assert [op.result for op in ops] == [4096] * 200
        assert set(rec.calls.values()) == {1}
    finally:
        os.close(fd)
    assert (directory / "mt.bin").read_bytes() == b"".join(bytes([i % 251]) * 4096 for i in range(200))


def test_callbacks_may_submit_to_their_own_ring(make_ring: Callable[..., Ring], disk: tuple[Path, int]) -> None:
    data = random.Random(9).randbytes(128 * KiB)
    fd = _open(disk, "chain.bin", data)
    try:
        ring = make_ring(depth=1)
        out = bytearray()
        done = threading.Event()
        buf = _buf(capacity=4096)

        def next_block(op: IOOp) -> None:
            out.extend(op.buf.view(0, op.result))
            if op.offset + 4096 < len(data):
                ring.submit([_op(OpKind.READ, fd, buf, 4096, op.offset + 4096, next_block)])
            else:
                done.set()

        ring.submit([_op(OpKind.READ, fd, buf, 4096, 0, next_block)])
        assert done.wait(20)
        assert bytes(out) == data
    finally:
        os.close(fd)


# ── io_uring specifics ─────────────────────────────────────────────────────────────────────────────────────


def test_uring_is_available_or_says_why() -> None:
    reason = uring.unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason)
    assert available_engines()["uring"] == reason
    if reason is None:
        assert make_engine("auto").name == "uring"
    if os.environ.get("KVSTREAM_REQUIRE_URING"):
        assert reason is None, reason


def test_uring_splits_ops_longer_than_one_sqe(monkeypatch: pytest.MonkeyPatch, disk: tuple[Path, int]) -> None:
    """Ops above the per-SQE cap (1 GiB in production) go out in pieces; the cap is lowered to test it."""
    _require_uring()
    monkeypatch.setattr(uring, "_MAX_SQE_BYTES", 8 * KiB)
    data = random.Random(13).randbytes(100 * KiB)  # not a multiple of the cap: the last piece is short
    fd = _open(disk, "split.bin", data + bytes(-len(data) % 4096))
    wfd = _open(disk, "split-out.bin", write=True)
    try:
        ring = uring.UringRing("split", depth=2)
        buf = _buf(capacity=104 * KiB)
        assert _run(ring, [_op(OpKind.READ, fd, buf, 100 * KiB, 0, _noop)]) == [100 * KiB]
        assert bytes(buf.view(0, 100 * KiB)) == data
        assert _run(ring, [_op(OpKind.WRITE, wfd, buf, 100 * KiB, 0, _noop)]) == [100 * KiB]
        ring.close()
    finally:
        os.close(fd)
        os.close(wfd)
    assert (disk[0] / "split-out.bin").read_bytes() == data


def test_uring_ordered_index_access_path(disk: tuple[Path, int]) -> None:
    """The aarch64 path (libatomic acquire/release on the ring indices) runs on x86-64 too."""
    _require_uring()
    if uring._libatomic() is None:
        pytest.skip("libatomic.so.1 not loadable here")
    data = random.Random(17).randbytes(64 * KiB)
    fd = _open(disk, "ordered.bin", data)
    try:
        ring = uring.UringRing("ordered", depth=4, _ordered=True)
        assert ring._raw.ordered
        bufs = [_buf(capacity=4096) for _ in range(16)]
        ops = [_op(OpKind.READ, fd, b, 4096, i * 4096, _noop) for i, b in enumerate(bufs)]
        assert _run(ring, ops) == [4096] * 16
        ring.close()
        assert b"".join(bytes(b.view()) for b in bufs) == data
    finally:
        os.close(fd)


def test_uring_raising_callback_does_not_stop_the_ring(disk: tuple[Path, int], caplog: pytest.LogCaptureFixture) -> None:
    _require_uring()
    fd = _open(disk, "raise.bin", bytes(16 * KiB))
    try:
        ring = uring.UringRing("raise", depth=2)
        rec = Recorder(4)

        def bad(op: IOOp) -> None:
            rec(op)
            raise RuntimeError("callback bug")

        ops = [_op(OpKind.READ, fd, _buf(capacity=4096), 4096, i * 4096, bad) for i in range(4)]
        assert _run(ring, ops) == [4096] * 4
        assert set(rec.calls.values()) == {1} and len(rec.calls) == 4
        assert "callback bug" in caplog.text
        ring.close()
    finally:
        os.close(fd)


def test_uring_rejects_negative_offsets() -> None:
    _require_uring()
    from kvstream.errors import UsageError

    ring = uring.UringRing("neg", depth=1)
    try:
        with pytest.raises(UsageError, match="offset"):
            ring.submit([_op(OpKind.READ, 0, _buf(capacity=4096), 4096, -1, _noop)])
        assert ring.inflight() == 0
    finally:
        ring.close()


def test_uring_ring_sizes_leave_room_for_every_completion() -> None:
    _require_uring()
    for depth in (1, 2, 6, 32, 100):
        ring = uring.UringRing("size", depth=depth)
        raw = ring._raw
        assert raw.sq_entries >= depth + 2 and raw.cq_entries >= 2 * raw.sq_entries
        ring.close()


# ── the raw reader and `kvstream probe` (built on the engines) ───────────────────────────────────────────────


def test_rawread_write_then_read_counts_every_byte(engine_name: str, disk: tuple[Path, int]) -> None:
    from kvstream.io.rawread import read_files, write_files

    directory, extra = disk
    paths = [directory / f"raw-{i}.bin" for i in range(3)]
    eng = make_engine(engine_name)
    w = write_files(paths, 256 * KiB, engine=eng, depth=4, op_bytes=64 * KiB, direct=bool(extra))
    assert w.bytes == 3 * 256 * KiB and w.ops == 12 and w.gbps > 0
    assert all(p.stat().st_size == 256 * KiB for p in paths)
    r = read_files(paths, engine=eng, depth=3, op_bytes=64 * KiB, direct=bool(extra), latencies=True)
    assert (r.bytes, r.ops, len(r.latencies)) == (3 * 256 * KiB, 12, 12)
    assert r.finished >= r.started and r.cpu_seconds >= 0
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:  # (fd, size) pairs, whole files per op by default; the caller's fds stay open
        r2 = read_files([(fd, 128 * KiB) for fd in fds], engine=eng, depth=2)
        assert (r2.bytes, r2.ops) == (3 * 128 * KiB, 3)
        os.fstat(fds[0])
    finally:
        for fd in fds:
            os.close(fd)


def test_rawread_reports_the_failing_file(tmp_path: Path) -> None:
    from kvstream.io.rawread import read_files

    with pytest.raises(OSError, match="fd 1000123 at offset 0"):
        read_files([(1_000_123, 8192)], engine=make_engine("threads"), depth=1)


def test_rawread_write_load_runs_until_stopped(disk: tuple[Path, int]) -> None:
    from kvstream.io.rawread import write_files

    directory, extra = disk
    stop = threading.Event()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", write_files(
        [directory / "load.bin"], 64 * KiB, engine=make_engine("threads"), depth=2, until=stop, direct=bool(extra), sync=False)))
    t.start()
    time.sleep(0.2)
    stop.set()
    t.join(10)
    assert not t.is_alive() and box["r"].bytes > 64 * KiB  # went round more than once


def test_rawread_tiers_concurrently(disk: tuple[Path, int]) -> None:
    from kvstream.io.rawread import read_tiers_concurrently, write_files

    directory, extra = disk
    tiers = {"a": [directory / "a0", directory / "a1"], "b": [directory / "b0"]}
    eng = make_engine("threads")
    for files in tiers.values():
        write_files(files, 128 * KiB, engine=eng, depth=2, direct=bool(extra))
    m = read_tiers_concurrently(tiers, engine=eng, depth=2, op_bytes=64 * KiB, direct=bool(extra))
    assert {k: v.bytes for k, v in m.tiers.items()} == {"a": 256 * KiB, "b": 128 * KiB}
    assert m.bytes == 384 * KiB and m.seconds >= max(v.seconds for v in m.tiers.values()) > 0
    w = read_tiers_concurrently(tiers, engine=eng, depth=2, op_bytes=64 * KiB, direct=bool(extra), seconds=0.3)
    assert w.window == 0.3 and all(r.bytes > 256 * KiB and r.seconds > 0.25 for r in w.tiers.values())  # went round
    assert w.sum_gbps == pytest.approx(sum(r.gbps for r in w.tiers.values()))
    with pytest.raises(OSError, match="tier 'b'"):
        read_tiers_concurrently({"a": tiers["a"], "b": [directory / "missing"]}, engine=eng, depth=1)


def test_drop_page_cache_and_direct_io_checks(disk: tuple[Path, int]) -> None:
    from kvstream.io.rawread import direct_io_problem, drop_page_cache, filesystem_type

    directory, extra = disk
    (directory / "c.bin").write_bytes(b"c" * 8192)
    assert drop_page_cache([directory / "c.bin", directory / "missing"]) == 1
    if extra:
        assert direct_io_problem(directory) is None
    if os.path.isdir("/dev/shm") and filesystem_type("/dev/shm") == "tmpfs":
        assert "tmpfs" in (direct_io_problem("/dev/shm") or "")


@pytest.mark.parametrize("text,value", [("4M", 4 << 20), ("48M", 48 << 20), ("256K", 256 << 10), ("1G", 1 << 30), ("4096", 4096), ("4MiB", 4 << 20), ("1.5M", 3 << 19)])
def test_probe_parse_size(text: str, value: int) -> None:
    from kvstream.commands.probe import parse_size

    assert parse_size(text) == value


def test_probe_command_json_and_cleanup(disk: tuple[Path, int], capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvstream.cli import main

    directory, extra = disk
    if not extra:
        pytest.skip("the probe needs a folder where O_DIRECT reaches a device")
    a, b = directory / "tier-a", directory / "tier-b"
    a.mkdir()
    b.mkdir()
    rc = main(["probe", str(a), str(b), "--size", "64K", "--total", "512K", "--depth", "2", "--engine", "threads", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["tiers"]) == {str(a), str(b)}
    for t in report["tiers"].values():
        assert t["write_gbps"] > 0 and t["read_gbps"] > 0 and t["read_p99_ms"] >= t["read_p50_ms"] > 0
        assert set(t["under_write_load"]) == {"read_gbps", "read_p50_ms", "read_p99_ms", "write_gbps"}
    assert report["aggregate"]["read_gbps"] > 0 and report["files_per_tier"] == 8
    assert list(a.iterdir()) == [] and list(b.iterdir()) == []  # its files are gone


def test_probe_refuses_bad_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstream.cli import main

    assert main(["probe", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such folder" in capsys.readouterr().err
    (tmp_path / "file").write_bytes(b"x")
    assert main(["probe", str(tmp_path / "file")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(["probe", str(tmp_path), "--size", "5000"]) == 2
    assert "multiple of 4096" in capsys.readouterr().err
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert main(["probe", "/dev/shm", "--total", "1M", "--size", "64K"]) == 2
        err = capsys.readouterr().err
        assert "/dev/shm" in err and ("tmpfs" in err or "O_DIRECT" in err)


def test_uring_broken_ring_still_calls_back_every_op_once(monkeypatch: pytest.MonkeyPatch, disk: tuple[Path, int], caplog: pytest.LogCaptureFixture) -> None:
    """If io_uring_enter itself fails for good (never seen; a bug or a dying kernel), every op still gets
    exactly one callback (-errno for those not done) and the ring refuses new work."""
    _require_uring()
    fd = _open(disk, "broken.bin", bytes(256 * KiB))
    try:
        ring = uring.UringRing("broken", depth=2)
        real_enter = ring._raw.enter
        calls = {"n": 0}

        def failing_enter(to_submit: int, min_complete: int, flags: int) -> int:
            calls["n"] += 1
            if calls["n"] > 3:
                raise OSError(errno.EFAULT, "injected")
            return real_enter(to_submit, min_complete, flags)

        monkeypatch.setattr(ring._raw, "enter", failing_enter)
        rec = Recorder(16)
        ops = [_op(OpKind.READ, fd, _buf(capacity=16 * KiB), 16 * KiB, (i % 16) * 16 * KiB, rec) for i in range(16)]
        ring.submit(ops)
        assert rec.done.wait(10) and ring.drain(5)
        assert len(rec.calls) == 16 and set(rec.calls.values()) == {1}
        assert {op.result for op in ops} <= {16 * KiB, -errno.EFAULT} and -errno.EFAULT in {op.result for op in ops}
        with pytest.raises(StoreClosedError, match="broken"):
            ring.submit(ops[:1])
        ring.close()
    finally:
        os.close(fd)


def test_due_timer_runs_in_due_order_and_survives_a_raising_callback():
    import time

    from kvstream.io.timer import DueTimer

    timer = DueTimer(name="test-timer")
    got: list[int] = []
    now = time.monotonic()

    def boom() -> None:
        raise RuntimeError("callback failed")

    timer.call_at(now + 0.03, lambda: got.append(3))
    timer.call_at(now + 0.01, boom)
    timer.call_at(now + 0.02, lambda: got.append(2))
    timer.call_at(now, lambda: got.append(1))
    deadline = time.monotonic() + 2
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert got == [1, 2, 3]
