"""kvstream: a multi-tier KV-cache storage engine for LLM serving."""

__version__ = "0.1.0"
