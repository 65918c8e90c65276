"""A single-node Ceph 16 cluster (mon, mgr, one bluestore OSD, mds) in ``kvs-dfs-srv``, CephFS mounted with
``ceph-fuse`` on each node.

Every path a daemon writes (data, run dir, admin sockets, logs, pid files, keyring) is in our temp folder via
``ceph.conf``, so nothing lands in ``/var/lib/ceph`` or ``/var/log/ceph``; the whole cluster *is* that folder,
so tear-down is: unmount the clients, kill the daemons by their pid files, remove the folder.

Sized for a 2-core test machine: authentication off (``auth * required = none``: only our namespaces can reach
the address), pool size 1, ``osd crush chooseleaf type = 0`` (one host), an 8 GiB *sparse* bluestore block
file, OSD memory capped (``osd memory target`` at its floor, a fixed 64 MiB bluestore cache), 8 placement
groups a pool. It behaves like Lustre/GPFS for our purposes: one metadata server, strongly coherent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .netns import NODES, SRV_ADDR, in_ns, kill_pids, run, unmount_clients

FS_NAME = "kvsdfs"
_CONF = """[global]
fsid = {fsid}
mon initial members = a
mon host = [v2:{addr}:3300,v1:{addr}:6789]
public network = {net}
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
keyring = {w}/keyring
run dir = {w}/run
admin socket = {w}/run/$cluster-$name.$pid.asok
log file = {w}/log/$cluster-$name.log
pid file = {w}/run/$name.pid
crash dir = {w}/crash
mon data = {w}/mon/$cluster-$id
osd data = {w}/osd/$cluster-$id
mds data = {w}/mds/$cluster-$id
mgr data = {w}/mgr/$cluster-$id
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon osd full ratio = 0.97
mon osd backfillfull ratio = 0.96
mon osd nearfull ratio = 0.95
mon max pg per osd = 1000
log to stderr = false
err to stderr = false
debug ms = 0

[mon]
mon data avail crit = 1
mon data avail warn = 2

[osd]
osd objectstore = bluestore
bluestore block create = true
bluestore block size = {block}
bluestore block db create = false
bluestore block wal create = false
bluestore fsck on mount = false
osd memory target = 939524096
osd memory base = 268435456
osd memory cache min = 67108864
bluestore cache autotune = false
bluestore cache size = 67108864
osd op num shards = 1
osd op num threads per shard = 2

[mds]
mds cache memory limit = 134217728

[client]
log file = {w}/log/$cluster-$name.$pid.log
client mount timeout = 30
"""


@dataclass
class CephCluster:
    """A running CephFS: ``mounts[node]`` is each node's mount point. Build with :func:`start`."""

    work: Path
    mounts: dict[str, Path] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    name: str = "ceph"

    @property
    def conf(self) -> Path:
        return self.work / "ceph.conf"

    def cli(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """The ``ceph`` command, from the server's namespace (the mon's address lives only there)."""
        return run(in_ns("srv", ["ceph", "-c", str(self.conf), "--connect-timeout", "15", *args]),
                   check=check, timeout=timeout)

    def daemon(self, *argv: str) -> None:
        """Start a daemon in the server namespace (it forks into the background and writes its pid file)."""
        run(in_ns("srv", [*argv, "-c", str(self.conf)]), timeout=120)

    def daemon_pids(self) -> list[int]:
        """Pids from our pid files (mon, mgr, osd, mds, clients), live ones only."""
        out = []
        for f in (self.work / "run").glob("*.pid"):
            try:
                pid = int(f.read_text().strip())
            except (OSError, ValueError):
                continue
            # Only a process that really is one of ours (its command line names our conf): a stale pid file
            # must not make us kill an unrelated process that got the same pid.
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(self.work).encode() in cmd:
                out.append(pid)
        return out

    def stop(self) -> None:
        """Tear down in reverse, tolerant of a set-up that stopped half way: unmount the clients (ceph-fuse
        exits), kill the daemons (mds, osd, mgr, mon) by pid, remove the folder (the whole cluster)."""
        t0 = time.monotonic()
        unmount_clients(self.mounts)
        for name in ("client.a", "client.b", "mds.a", "osd.0", "mgr.a", "mon.a"):
            f = self.work / "run" / f"{name}.pid"
            pids = [p for p in self.daemon_pids() if f.exists() and f.read_text().strip() == str(p)]
            kill_pids(pids, grace_s=5.0)
        kill_pids(self.daemon_pids(), grace_s=1.0)  # anything else of ours (a second mgr, a restarted daemon)
        shutil.rmtree(self.work, ignore_errors=True)
        self.timings["teardown_s"] = time.monotonic() - t0


def start(work: Path, *, block_bytes: int = 8 << 30) -> CephCluster:
    """Bootstrap the cluster and mount CephFS on every node; stops what it started if any step fails."""
    c = CephCluster(work=work)
    t0 = time.monotonic()
    try:
        _start(c, block_bytes, t0)
    except BaseException:
        c.stop()
        raise
    c.timings["setup_s"] = time.monotonic() - t0
    return c


def _wait(what: str, probe, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"ceph: {what} not ready within {timeout:.0f} s")
        time.sleep(0.5)


def _start(c: CephCluster, block_bytes: int, t0: float) -> None:
    w = c.work
    for sub in ("run", "log", "crash", "mon/ceph-a", "osd/ceph-0", "mds/ceph-a", "mgr/ceph-a"):
        (w / sub).mkdir(parents=True, exist_ok=True)
    fsid = str(uuid.uuid4())
    net = SRV_ADDR.rsplit(".", 1)[0] + ".0/24"
    c.conf.write_text(_CONF.format(fsid=fsid, addr=SRV_ADDR, net=net, w=w, block=block_bytes))
    run(["ceph-authtool", "--create-keyring", str(w / "keyring"), "--gen-key", "-n", "mon.", "--cap", "mon",
         "allow *"])
    run(["monmaptool", "--create", "--addv", "a", f"[v2:{SRV_ADDR}:3300,v1:{SRV_ADDR}:6789]", "--fsid", fsid,
         str(w / "monmap")])
    # In the server namespace: the mon looks for its `public network` address among the interfaces it sees.
    run(in_ns("srv", ["ceph-mon", "-c", str(c.conf), "--mkfs", "-i", "a", "--monmap", str(w / "monmap"),
                      "--keyring", str(w / "keyring")]))
    c.daemon("ceph-mon", "-i", "a")
    _wait("mon", lambda: c.cli("mon", "stat", check=False, timeout=20).returncode == 0, 60)
    c.timings["mon_s"] = time.monotonic() - t0
    c.daemon("ceph-mgr", "-i", "a")
    osd_uuid = str(uuid.uuid4())
    osd_id = c.cli("osd", "new", osd_uuid).stdout.strip()
    if osd_id != "0":
        raise RuntimeError(f"ceph: expected osd id 0, got {osd_id!r}")
    run(in_ns("srv", ["ceph-osd", "-c", str(c.conf), "-i", "0", "--mkfs", "--osd-uuid", osd_uuid]), timeout=180)
    c.daemon("ceph-osd", "-i", "0")

    def osd_up() -> bool:
        p = c.cli("osd", "stat", "-f", "json", check=False, timeout=20)
        return p.returncode == 0 and json.loads(p.stdout).get("num_up_osds") == 1

    _wait("osd", osd_up, 120)
    c.timings["osd_s"] = time.monotonic() - t0
    for pool in ("kvs_meta", "kvs_data"):
        c.cli("osd", "pool", "create", pool, "8")
        c.cli("osd", "pool", "set", pool, "size", "1", "--yes-i-really-mean-it")
    c.cli("fs", "new", FS_NAME, "kvs_meta", "kvs_data")
    c.daemon("ceph-mds", "-i", "a")

    def mds_active() -> bool:
        p = c.cli("fs", "status", FS_NAME, "-f", "json", check=False, timeout=20)
        if p.returncode != 0:
            p = c.cli("mds", "stat", check=False, timeout=20)
            return p.returncode == 0 and "up:active" in p.stdout
        return any(m.get("state") == "active" for m in json.loads(p.stdout).get("mdsmap", []))

    _wait("mds", mds_active, 120)
    c.timings["mds_s"] = time.monotonic() - t0
    for node in NODES:
        mp = Path(f"/mnt/kvs-dfs-ceph-{node}")
        mp.mkdir(exist_ok=True)
        c.mounts[node] = mp
        run(in_ns(node, ["ceph-fuse", "-c", str(c.conf), "--id", node, "-m", f"{SRV_ADDR}:6789",
                          "--pid-file", str(w / "run" / f"client.{node}.pid"), str(mp)]), timeout=90)
        if not os.path.ismount(mp):
            raise RuntimeError(f"ceph-fuse returned but {mp} is not a mount point")
    c.timings["mounted_s"] = time.monotonic() - t0
