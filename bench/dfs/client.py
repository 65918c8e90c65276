"""The test's side of a node worker (:mod:`node`): start it inside a node, send commands, read replies,
SIGKILL it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .netns import in_node

NODE_PY = Path(__file__).resolve().parent / "node.py"


class NodeError(RuntimeError):
    """A worker command failed (its traceback is in the message) or the worker died."""


class NodeProcess:
    """One kvstream process on node ``node`` (``a``/``b``). Every process started is ended by :meth:`stop`
    (also after a SIGKILL), and the fixture that made it calls that on the way out."""

    def __init__(self, node: str, journal: Path, log: Path) -> None:
        self.node = node
        self.log_path = log
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(in_node(node, [sys.executable, str(NODE_PY), "--journal", str(journal)]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1)
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ready = self._next(30)
        self.host_pid: int = ready["host_pid"]
        self.hostname: str = ready["hostname"]
        self.killed = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._q.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._q.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            msg = self._q.get(timeout=timeout)
        except queue.Empty:
            raise NodeError(f"node {self.node}: no answer within {timeout:.0f} s") from None
        if msg is None:
            raise NodeError(f"node {self.node}: worker exited (rc {self.proc.poll()}); log tail:\n{self.log_tail()}")
        return msg

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = 120, on_event=None) -> dict[str, Any]:
        """The reply to the last command; ``on_event`` gets each event (``acked`` batches) before it."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._next(max(0.1, deadline - time.monotonic()))
            if msg.get("event") == "reply":
                if not msg["ok"]:
                    raise NodeError(f"node {self.node}: {msg['op']} failed: {msg['error']}\n{msg['traceback']}")
                return msg
            if on_event is not None:
                on_event(msg)

    def next_event(self, timeout: float) -> dict[str, Any]:
        return self._next(timeout)

    def call(self, op: str, timeout: float = 120, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.reply(timeout)

    def kill(self) -> None:
        """SIGKILL the store's process itself (not a wrapper): no close, no flush, no atexit."""
        try:
            os.kill(self.host_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.killed = True
        self.proc.wait(30)

    def stop(self) -> None:
        """Ask the worker to close its store and exit; kill it if it does not within 60 s."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.kill()
        self._log.close()
