"""A GlusterFS 10 distribute volume (two bricks) served from ``kvs-dfs-srv``, FUSE-mounted on each node.

The server (glusterd and the brick daemons it spawns) runs in the server's network namespace *and* a private
mount namespace in which ``/var/log/glusterfs`` and ``/run/gluster`` are our own folders: glusterd writes brick
logs and sockets under those fixed paths whatever its volfile says, and a test must not write into the host's
state. Its working directory, socket and logs are in our temp folder too (``glusterd.vol`` below). Killing
glusterd and the bricks ends that mount namespace; nothing is left on the host.

Two bricks on one server make a *distribute* volume: files are spread by name hash, so a chunk and its
folder can live on different bricks, which is the weakly consistent case (TESTBED recipe 3).
Each node's client (``glusterfs`` FUSE daemon) runs in that node's network namespace with its mount in the
host's mount namespace at ``/mnt/kvs-dfs-gluster-<node>``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .netns import NODES, SRV_ADDR, in_ns, kill_pids, ns_path, run, unmount_clients

VOLUME = "kvsdfs"
_VOLFILE = """volume management
    type mgmt/glusterd
    option working-directory {work}/lib
    option run-directory {work}/run
    option glusterd-sockfile {work}/glusterd.socket
    option transport-type socket
    option transport.socket.listen-port 24007
    option transport.socket.keepalive-time 10
    option transport.socket.keepalive-interval 2
    option transport.socket.read-fail-log off
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
"""


@dataclass
class GlusterCluster:
    """A running volume: ``mounts[node]`` is each node's mount point. Build with :func:`start`."""

    work: Path
    mounts: dict[str, Path] = field(default_factory=dict)
    glusterd_pid: int | None = None
    volume_started: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    name: str = "gluster"

    def cli(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """``gluster`` in glusterd's own namespaces (its socket is in our folder, its address in srv)."""
        assert self.glusterd_pid is not None
        return run(["nsenter", "-t", str(self.glusterd_pid), "-m", "-n", "--", "gluster",
                    f"--glusterd-sock={self.work}/glusterd.socket", "--mode=script", *args],
                   check=check, timeout=timeout)

    def server_pids(self) -> list[int]:
        """glusterd and the brick daemons (every process in glusterd's mount namespace)."""
        if self.glusterd_pid is None:
            return []
        try:
            mnt = os.readlink(f"/proc/{self.glusterd_pid}/ns/mnt")
        except FileNotFoundError:
            return []
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.readlink(f"/proc/{d}/ns/mnt") == mnt:
                        out.append(int(d))
                except OSError:
                    pass
        return out

    def stop(self) -> None:
        """Tear down in reverse, each step tolerant of a set-up that stopped half way: unmount the nodes'
        clients, stop and delete the volume, kill glusterd and the bricks by pid, remove the folder."""
        t0 = time.monotonic()
        unmount_clients(self.mounts)
        if self.glusterd_pid is not None:
            if self.volume_started:
                self.cli("volume", "stop", VOLUME, "force", check=False)
                self.volume_started = False
            self.cli("volume", "delete", VOLUME, check=False)
            kill_pids(self.server_pids())
            self.glusterd_pid = None
        shutil.rmtree(self.work, ignore_errors=True)
        self.timings["teardown_s"] = time.monotonic() - t0


def start(work: Path) -> GlusterCluster:
    """Start glusterd in ``kvs-dfs-srv``, create and start the volume, mount it on every node. On any failure
    what was started is stopped before the error propagates."""
    c = GlusterCluster(work=work)
    t0 = time.monotonic()
    try:
        _start(c, t0)
    except BaseException:
        c.stop()
        raise
    c.timings["setup_s"] = time.monotonic() - t0
    return c


def _start(c: GlusterCluster, t0: float) -> None:
    w = c.work
    for sub in ("lib", "run", "log", "rundir", "b1", "b2"):
        (w / sub).mkdir(parents=True, exist_ok=True)
    (w / "glusterd.vol").write_text(_VOLFILE.format(work=w))
    binds = " && ".join(f"mount --bind {w}/{src} {dst}" for src, dst in
                        (("log", "/var/log/glusterfs"), ("rundir", "/run/gluster")) if os.path.isdir(dst))
    script = (f"{binds} && " if binds else "") + (
        f"exec glusterd -f {w}/glusterd.vol -p {w}/glusterd.pid -l {w}/log/glusterd.log")
    run(["nsenter", f"--net={ns_path('srv')}", "--", "unshare", "--mount", "--propagation", "private", "--",
         "sh", "-c", script])
    pidfile = w / "glusterd.pid"
    deadline = time.monotonic() + 20
    while True:
        if pidfile.exists() and pidfile.read_text().strip().isdigit():
            c.glusterd_pid = int(pidfile.read_text())
            if c.cli("volume", "list", check=False, timeout=10).returncode == 0:
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"glusterd did not answer within 20 s (log: {w}/log/glusterd.log)")
        time.sleep(0.1)
    c.timings["glusterd_s"] = time.monotonic() - t0
    c.cli("volume", "create", VOLUME, f"{SRV_ADDR}:{w}/b1", f"{SRV_ADDR}:{w}/b2", "force")
    c.cli("volume", "start", VOLUME)
    c.volume_started = True
    for node in NODES:
        mp = Path(f"/mnt/kvs-dfs-gluster-{node}")
        mp.mkdir(exist_ok=True)
        c.mounts[node] = mp
        run(in_ns(node, ["mount", "-t", "glusterfs", "-o", f"log-file={w}/log/client-{node}.log",
                          f"{SRV_ADDR}:/{VOLUME}", str(mp)]), timeout=60)
        if not os.path.ismount(mp):
            raise RuntimeError(f"mount.glusterfs returned but {mp} is not a mount point")
