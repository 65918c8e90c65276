"""``kvstream verify --config``: replica deficits per tier are reported (a warning, an error with --strict), and
``--repair`` writes them through the store's catch-up (issue 13: "verify reports replica deficits per tier;
verify --repair copies them")."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

import kvstream


def make(disk_tmp):
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "local"), "capacity_bytes": "64MiB"},
                     {"name": "shared", "path": str(disk_tmp / "shared"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "16MiB", "create_dirs": True, "io_engine": "threads", "node_id": "n1"}
    path = disk_tmp / "store.yaml"
    path.write_text(yaml.safe_dump(cfg))
    keys = [bytes([i]) * 16 for i in range(10)]
    with kvstream.open_store(cfg) as s:
        for k in keys:
            s.put(k, np.random.default_rng(k[0]).bytes(30_000))
        s.flush()
        assert s.drain(10)
    # A crash before the owed journal reached the disk: 4 shared copies gone, nothing owed.
    with kvstream.open_store({**cfg, "tiers": cfg["tiers"][1:], "router": "single:shared"}) as only_shared:
        for k in keys[:4]:
            only_shared.remove(k)
    return path, keys


def verify(*args: str) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "kvstream", "verify", *args, "--json"], capture_output=True, text=True)
    return p.returncode, json.loads(p.stdout)


@pytest.mark.slow
def test_deficits_are_reported_and_repaired(disk_tmp):
    path, keys = make(disk_tmp)
    rc, out = verify("--config", str(path))
    assert rc == 0 and out["replicas"]["deficits"] == {"shared": 4} and out["replicas"]["missing"] == 4
    rc, _ = verify("--config", str(path), "--strict")
    assert rc == 1  # a missing replica fails --strict
    rc, out = verify("--config", str(path), "--repair")
    assert rc == 0 and out["replicas"]["deficits"] == {"shared": 0} and out["replicas"]["owed"] == {"local": 0, "shared": 0}
    with kvstream.open_store(str(path)) as s:
        assert all(s.tiers[1].contains(k) for k in keys)


def test_verify_without_paths_or_config_says_what_to_give():
    p = subprocess.run([sys.executable, "-m", "kvstream", "verify"], capture_output=True, text=True)
    assert p.returncode == 2 and "--config" in p.stderr and "Traceback" not in p.stderr
