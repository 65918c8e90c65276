"""Sub-commands of the ``kvstream`` CLI: one module each, each with ``register(subparsers)``.

A handler is set with ``parser.set_defaults(handler=fn)`` and returns the exit code.
"""
