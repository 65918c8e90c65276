"""Test kits shipped with kvstream, for tiers written outside it too.

- :mod:`kvstream.testing.tier`: :class:`~kvstream.testing.tier.TierConformance`, the conformance suite of the tier
  contract (:mod:`kvstream.tiers.contract`); needs pytest (the ``test`` extra).
- :mod:`kvstream.testing.tier_io`: writing and reading whole chunks through a file tier's rings, as the store
  does (no pytest needed).
- :mod:`kvstream.testing.store`: deterministic payloads and keys, a two-tier configuration, put-and-flush and
  check-everything loops for tests that drive a whole store, the I/O engines as pytest parameters.
- :mod:`kvstream.testing.serving`: a linear cost model and a dictionary backend for the serving core's tests.
- :mod:`kvstream.testing.read_step`: a read step driven on an ideal clock.
- :mod:`kvstream.testing.lmcache`: the LMCache plugin's harness through LMCache's StorageManager (needs lmcache
  and torch; importing it sets LMCache's no-telemetry environment first).

The project's own tests import their shared helpers from here, never from each other (tests/README.md).

Importing this package imports none of them.
"""
