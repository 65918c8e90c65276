"""Benchmark drivers behind ``kvstream bench``: each measures the store beside the bound it is held to,
in the same run, and reports ratios (TESTBED.md, "Rules")."""
