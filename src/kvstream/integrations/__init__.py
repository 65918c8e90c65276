"""Integrations of the kvstream store with serving engines and caches.

- :mod:`kvstream.integrations.lmcache` — an LMCache (0.5.6) storage plugin, ``KVStreamBackend``. It imports
  LMCache and torch; nothing else in kvstream does, so ``import kvstream`` works without them.

The ``_lmcache_*`` helper modules hold the parts of the plugin that need neither LMCache nor torch (config
parsing, key mapping, metrics, the write queue) so they can be tested on their own.
"""

__all__: list[str] = []
