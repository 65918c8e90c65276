"""Coverage-guided fuzzing (atheris) of the trace readers: ``python fuzz/fuzz_traces.py -runs=N``.

Contract: :func:`kvstream.workload.mooncake.read_mooncake` and :func:`kvstream.workload.bidaw.read_bidaw_trace`
return requests or raise :class:`InputFormatError` naming the file and a line that exists. The first input byte
picks the reader. ``KVS_FUZZ_TOLERATE=UnicodeDecodeError,RecursionError`` lets known defects pass so the
search can go on past them (see RELIABILITY.md).
"""

import os
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from kvstream.errors import InputFormatError
    from kvstream.workload.bidaw import read_bidaw_trace
    from kvstream.workload.mooncake import read_mooncake

# fuzz/run.py passes a folder it removes afterwards (libFuzzer ends the process without running atexit)
_DIR = Path(os.environ.get("KVS_FUZZ_TMP") or tempfile.mkdtemp(prefix="kvs-fuzz-traces-",
                                                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
_TOLERATE = tuple(getattr(__builtins__, n, None) or __import__("builtins").__dict__[n]
                  for n in filter(None, os.environ.get("KVS_FUZZ_TOLERATE", "").split(",")))


def one_input(data: bytes) -> None:
    if not data:
        return
    reader = read_mooncake if data[0] % 2 == 0 else read_bidaw_trace
    p = _DIR / ("t.jsonl" if reader is read_mooncake else "t.txt")
    p.write_bytes(data[1:])
    try:
        reader(p)
    except InputFormatError as exc:
        lines = data[1:].count(b"\n") + 1
        assert exc.path == str(p) and 1 <= exc.line <= lines + data[1:].count(b"\r"), (exc.line, lines)
    except _TOLERATE:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
