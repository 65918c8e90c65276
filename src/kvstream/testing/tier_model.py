"""A tier against a plain model, driven by hypothesis' state machine: publishes, republishes, drops, reopens.

The model is an LRU list of (key → version) with room for ``capacity`` chunks, evicting as the tier kind does:
a file tier makes room in ``reserve`` *before* it publishes (so a republish into a full tier evicts the least
recently used chunk first, possibly the key itself, and then wins or loses), a modelled tier publishes and then
evicts down to capacity (``fit``). A reopen keeps every chunk; the order among them is the tier's to choose, but
all of them go before any chunk published later. After every step the tier lists exactly the model's keys, ``used_bytes`` is
their sizes, and a file tier reads back the version the model holds.

:func:`run_model` is called by :meth:`kvstream.testing.tier.TierConformance.test_matches_the_model`; it imports
hypothesis when called (the ``test`` extra).
"""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstream.testing.tier_io import Failed, Refused, read_chunk, write_chunk
from kvstream.tiers.contract import FileTier, ModelledTier, Tier

__all__ = ["run_model"]


def run_model(open_tier: Callable[[Path], Tier[Any]], root: Path, *, capacity: int, chunk: int,
              payload: Callable[[int], bytes], key: Callable[[int], bytes], read_faults: bool = False,
              examples: int = 12, steps: int = 25) -> None:
    """Run the state machine: ``open_tier(folder)`` opens the tier kind (each example in a new folder under
    ``root``), which holds ``capacity`` chunks of ``chunk`` bytes; ``payload(v)``/``key(i)`` as the suite's."""
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

    keys = [key(i) for i in range(capacity + 3)]
    root.mkdir(parents=True, exist_ok=True)

    class TierVsModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.folder = Path(tempfile.mkdtemp(prefix="tier-model-", dir=root))
            self.opened: list[Tier[Any]] = []
            self.tier = self._open()
            self.model: OrderedDict[bytes, int] = OrderedDict()  # key -> version, least recently used first
            self.unordered: set[bytes] = set()  # keys listed at a reopen: evicted before any newer, in any order
            self.version = 0
            self.clock = 0.0

        def _open(self) -> Tier[Any]:
            t = open_tier(self.folder / "tier")
            self.opened.append(t)
            return t

        def _files(self) -> FileTier | None:
            if self.tier.capabilities.modelled:
                return None
            assert isinstance(self.tier, FileTier)
            return self.tier

        @rule(k=st.sampled_from(keys))
        def publish(self, k: bytes) -> None:
            self.version += 1
            v, ft = self.version, self._files()
            if ft is not None:
                full = len(self.model) >= capacity
                won = write_chunk(ft, k, payload(v))
                assert not isinstance(won, Refused)
                if full:  # reserve made room first: the least recently used went, possibly the key itself
                    gone = [x for x in self.model if x != k and not ft.contains(x)]
                    assert len(gone) <= 1, f"{len(gone)} chunks evicted to make room for one"
                    victim = gone[0] if gone else k
                    assert victim in self.model, "a full tier published without evicting"
                    if self.unordered:  # listed at a reopen, in an order the model does not know: older than all
                        assert victim in self.unordered, "a chunk published since the reopen went first"
                    else:
                        assert victim == next(iter(self.model)), "not the least recently used"
                    del self.model[victim]
                    self.unordered.discard(victim)
            else:
                assert isinstance(self.tier, ModelledTier)
                self.clock += 1.0
                won = self.tier.publish(k, chunk, now=self.clock)
                self.tier.fit(now=self.clock)
            assert won is (k not in self.model), "first wins: a held key's publish loses, a new key's wins"
            if won:
                self.model[k] = v
                while len(self.model) > capacity:  # a modelled tier evicts after the publish
                    self.model.popitem(last=False)

        @precondition(lambda self: not self.tier.capabilities.modelled)
        @rule(k=st.sampled_from(keys))
        def drop(self, k: bytes) -> None:
            ft = self._files()
            assert ft is not None
            ft.drop(k)
            self.model.pop(k, None)
            self.unordered.discard(k)

        @precondition(lambda self: self.tier.capabilities.durable)
        @rule()
        def reopen(self) -> None:
            """Close and open again: the chunks stay, their eviction order is rebuilt from the index (in an order
            the model does not know: all of them still go before anything published later)."""
            close = getattr(self.tier, "close", None)
            if close is not None:
                close()
            self.opened.remove(self.tier)
            self.tier = self._open()
            self.unordered = set(self.model)

        @invariant()
        def lists_the_model(self) -> None:
            assert [k for k in keys if self.tier.contains(k)] == [k for k in keys if k in self.model]
            assert self.tier.used_bytes == chunk * len(self.model)
            ft = self._files()
            if ft is None or not self.model:
                return
            k = next(reversed(self.model))  # the newest: read it back
            for _ in range(40 if read_faults else 1):
                got = read_chunk(ft, k)
                if isinstance(got, Failed) and read_faults:
                    continue
                assert got == payload(self.model[k]), f"read {got!r:.60}"
                break

        def teardown(self) -> None:
            for t in self.opened:
                close = getattr(t, "close", None)
                if close is not None:
                    close()
            shutil.rmtree(self.folder, ignore_errors=True)

    run_state_machine_as_test(TierVsModel, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
