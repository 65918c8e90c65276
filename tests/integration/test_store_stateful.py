"""The store against a plain dict, driven by hypothesis' state machine: put, flush, read, evict, remove, reopen."""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvstream
from kvstream.testing.store import disk_tmp_root

KEYS = [bytes([i]) * 16 for i in range(12)]


class StoreVsDict(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="kvstream-stateful-", dir=disk_tmp_root())
        self.model: dict[bytes, bytes] = {}
        self.store = self._open()

    def _open(self, router: str = "mitm") -> kvstream.Store:
        return kvstream.open_store({
            "tiers": [{"name": "local", "path": f"{self.root}/l", "capacity_bytes": "64MiB"},
                      {"name": "shared", "path": f"{self.root}/s", "capacity_bytes": "64MiB"}],
            "memory_bytes": "1MiB", "create_dirs": True, "router": router, "io_engine": "threads",
        })

    @rule(k=st.sampled_from(KEYS), size=st.integers(1, 70000), fill=st.integers(0, 255))
    def put(self, k, size, fill):
        accepted = self.store.put(k, bytes([fill]) * size)
        if k in self.model:
            assert not accepted  # same key, same bytes: the first put wins
        elif accepted:
            self.model[k] = bytes([fill]) * size

    @rule()
    def flush(self):
        self.store.flush()

    @rule()
    def drain(self):
        self.store.flush()
        assert self.store.drain(timeout=30)

    @rule()
    def evict_memory(self):
        self.store.evict_memory()

    @rule(k=st.sampled_from(KEYS))
    def remove(self, k):
        self.store.drain(timeout=30)  # a chunk still being written reappears when its write publishes
        assert self.store.remove(k) == (k in self.model)
        self.model.pop(k, None)

    @rule(router=st.sampled_from(["mitm", "mitm:2", "fixed:0.5", "single:shared"]))
    def reopen(self, router):
        self.store.close()
        self.store = self._open(router)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=8))
    def read(self, keys):
        out = self.store.get_many(keys)
        for k, v in zip(keys, out):
            if k in self.model:
                assert v is not None and bytes(v) == self.model[k]
            else:
                assert v is None

    @invariant()
    def lookup_matches(self):
        for k in KEYS:
            assert self.store.contains(k) == (k in self.model)

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)


StoreVsDict.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
TestStoreVsDict = pytest.mark.slow(StoreVsDict.TestCase)
