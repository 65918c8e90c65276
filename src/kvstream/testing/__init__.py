"""Test kits shipped with kvstream, for tiers written outside it too.

- :mod:`kvstream.testing.tier`: :class:`~kvstream.testing.tier.TierConformance`, the conformance suite of the tier
  contract (:mod:`kvstream.tiers.contract`); needs pytest (the ``test`` extra).
- :mod:`kvstream.testing.tier_io`: writing and reading whole chunks through a file tier's rings, as the store
  does (no pytest needed).

Importing this package imports neither.
"""
