"""Network namespaces for a two-node testbed: ``kvs-dfs-srv`` (the file system's servers) and ``kvs-dfs-a``,
``kvs-dfs-b`` (the nodes), joined by a bridge in the server namespace.

Why namespaces and not just loopback: each node's FUSE client must be a separate client with its own caches
and its own connection, as on a real cluster, and a node must be cut off / killed without touching the other.
Addresses are private (10.213.7.0/24) and exist only inside these namespaces; nothing is routed to the host.

Why ``nsenter --net`` and not ``ip netns exec``: ``ip netns exec`` also unshares the mount namespace, so a
FUSE mount made there is invisible outside. With ``nsenter --net`` the client daemon lives in the node's
network namespace while its mount (``/mnt/kvs-dfs-<fs>-<node>``) is in the host's mount namespace.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PREFIX = "kvs-dfs-"
SRV = "kvs-dfs-srv"
NODES = ("a", "b")
SUBNET = "10.213.7"
SRV_ADDR = f"{SUBNET}.1"
NODE_ADDR = {"a": f"{SUBNET}.2", "b": f"{SUBNET}.3"}
BRIDGE = "kvs-dfs-br"
NETNS_DIR = Path("/run/netns")


def ns_name(node: str) -> str:
    """The namespace of a node (``a``/``b``) or of the server (``srv``)."""
    return f"{PREFIX}{node}"


def ns_path(node: str) -> str:
    return str(NETNS_DIR / ns_name(node))


def in_ns(node: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run in a namespace's network only (host mounts, host pids): see the module docstring."""
    return ["nsenter", f"--net={ns_path(node)}", "--", *argv]


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; on failure raise with the command's stderr in the message."""
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} -> exit {p.returncode}: {(p.stderr or p.stdout).strip()[-2000:]}")
    return p


def missing() -> str | None:
    """Why the testbed cannot run here (None if it can): root, /dev/fuse and ``ip netns`` are needed."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, FUSE mounts, file system daemons)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: the kernel has no FUSE"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "no `ip`/`nsenter` (iproute2, util-linux)"
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if p.returncode != 0:
        return f"`ip netns` does not work here: {p.stderr.strip()}"
    return None


def existing() -> list[str]:
    """Our namespaces that exist now (``kvs-dfs-*``)."""
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def create() -> None:
    """Make the three namespaces, the bridge and a veth pair per node. Fails if any of them exists already
    (run :func:`clean_leftovers` first: a crashed run's state must not be mistaken for ours)."""
    left = existing()
    if left:
        raise RuntimeError(f"namespaces of an earlier run still exist: {left} (python bench/dfs/up.py down)")
    for n in ("srv", *NODES):
        run(["ip", "netns", "add", ns_name(n)])
        run(["ip", "-n", ns_name(n), "link", "set", "lo", "up"])
    run(["ip", "-n", SRV, "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "-n", SRV, "addr", "add", f"{SRV_ADDR}/24", "dev", BRIDGE])
    run(["ip", "-n", SRV, "link", "set", BRIDGE, "up"])
    for n in NODES:
        # Both ends are created directly inside their namespaces (never in the host's), so no host
        # interface ever exists, even for a moment.
        host_end, node_end = f"kvs-dfs-{n}s", f"kvs-dfs-{n}n"
        run(["ip", "-n", SRV, "link", "add", host_end, "type", "veth", "peer", "name", node_end,
             "netns", ns_name(n)])
        run(["ip", "-n", SRV, "link", "set", host_end, "master", BRIDGE, "up"])
        run(["ip", "-n", ns_name(n), "addr", "add", f"{NODE_ADDR[n]}/24", "dev", node_end])
        run(["ip", "-n", ns_name(n), "link", "set", node_end, "up"])
    # The bridge forwards once its ports are up; wait until each node reaches the server (a refused TCP
    # connection proves reachability; no ping binary is needed).
    probe = ("import socket,sys\ns=socket.socket();s.settimeout(1)\n"
             "try: s.connect((sys.argv[1], 9))\nexcept ConnectionRefusedError: sys.exit(0)\n"
             "except OSError: sys.exit(1)\n")
    deadline = time.monotonic() + 10
    for n in NODES:
        while run(in_ns(n, [sys.executable, "-c", probe, SRV_ADDR]), check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {n} cannot reach {SRV_ADDR}")
            time.sleep(0.1)


_INIT_PROCS: list[subprocess.Popen] = []  # reaped by destroy()


def start_node_inits() -> dict[str, int]:
    """Give each node its own PID and UTS namespace, held open by a ``sleep`` as its pid 1; returns the host
    pid of each node's init.

    Why: on a real cluster a pid means nothing on another node, and a restarted process gets a new pid. The
    engine uses pids to tell a dead writer's index log and temporaries from a live one's, so a testbed where
    both "nodes" share one pid space would hide exactly the bugs two hosts expose. Each node's pids start at a
    different offset (``ns_last_pid``) so the two nodes' workers do not get the same numbers by construction,
    and the hostname (the default ``node_id``) is ``kvs-dfs-<node>``."""
    inits = {}
    for i, n in enumerate(NODES):
        script = (f"hostname {ns_name(n)} && echo {1000 * (i + 1)} > /proc/sys/kernel/ns_last_pid && "
                  "exec sleep infinity")
        p = subprocess.Popen(in_ns(n, ["unshare", "--pid", "--uts", "--fork", "--kill-child", "--",
                                        "sh", "-c", script]),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _INIT_PROCS.append(p)
        deadline = time.monotonic() + 10
        while (pid := node_init_pid(n)) is None:
            if p.poll() is not None or time.monotonic() > deadline:
                err = p.stderr.read().decode(errors="replace") if p.poll() is not None else "timeout"
                raise RuntimeError(f"node {n}: could not start its pid namespace: {err.strip()}")
            time.sleep(0.02)
        inits[n] = pid
    return inits


def node_init_pid(node: str) -> int | None:
    """Host pid of a node's init (the process in the node's network namespace that is pid 1 of its own PID
    namespace and runs ``sleep``), or None."""
    for pid in pids_in(ns_name(node)):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        nspid = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
        if comm == "sleep" and len(nspid) == 2 and nspid[1] == "1":
            return pid
    return None


def in_node(node: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run as a process of a node: its network, PID and UTS namespaces (host mounts)."""
    pid = node_init_pid(node)
    if pid is None:
        raise RuntimeError(f"node {node} has no init (netns.start_node_inits)")
    return ["nsenter", "-t", str(pid), "--net", "--pid", "--uts", "--", *argv]


def pids_in(name: str) -> list[int]:
    """Processes whose network namespace is ``name`` (all of them were started by us: the namespace is ours)."""
    p = run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def kill_pids(pids: Sequence[int], *, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, each pid given (and only those)."""
    live = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            live.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        live = [p for p in live if _alive(p)]
        time.sleep(0.05)
    for pid in live:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while live and time.monotonic() < deadline:
        live = [p for p in live if _alive(p)]
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process. A process can be reaped between the open and the read of
    its stat file, and the read then raises ESRCH (ProcessLookupError), so every OSError means gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def our_mounts() -> list[str]:
    """Mount points of ours (``/mnt/kvs-dfs-*``), deepest first."""
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            mp = line.split()[1].replace("\\040", " ")
            if mp.startswith("/mnt/" + PREFIX):
                out.append(mp)
    return sorted(set(out), key=len, reverse=True)


def unmount(mountpoint: str) -> None:
    """Unmount a FUSE mount: normally, else lazily (a dead server can leave it busy or hung)."""
    if run(["umount", mountpoint], check=False, timeout=30).returncode != 0:
        run(["umount", "-l", mountpoint], check=False, timeout=30)


def unmount_clients(mounts: dict) -> None:
    """Unmount every node's client in ``mounts`` (node -> mount point), remove the mount points and empty the
    dict; tolerant of mounts a half-finished set-up never made."""
    for node, mp in list(mounts.items()):
        if os.path.ismount(mp):
            unmount(str(mp))
        try:
            mp.rmdir()
        except OSError:
            pass
        del mounts[node]


def destroy() -> None:
    """Delete our namespaces (their links go with them). Processes still in them are killed first."""
    for name in existing():
        kill_pids(pids_in(name), grace_s=1.0)
        run(["ip", "netns", "del", name], check=False)
    while _INIT_PROCS:
        p = _INIT_PROCS.pop()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def clean_leftovers(tmp_root: Path | None = None) -> list[str]:
    """Undo a crashed run: unmount ``/mnt/kvs-dfs-*``, kill the processes in ``kvs-dfs-*`` namespaces, delete
    the namespaces, remove ``kvs-dfs-*`` folders under ``tmp_root`` and the mount points. Returns what it did."""
    done = []
    for mp in our_mounts():
        unmount(mp)
        done.append(f"unmounted {mp}")
    for name in existing():
        pids = pids_in(name)
        if pids:
            kill_pids(pids)
            done.append(f"killed {len(pids)} process(es) in {name}")
    for name in existing():
        run(["ip", "netns", "del", name], check=False)
        done.append(f"deleted namespace {name}")
    for mp in Path("/mnt").glob(PREFIX + "*"):
        try:
            mp.rmdir()
            done.append(f"removed {mp}")
        except OSError:
            pass
    if tmp_root is not None and tmp_root.is_dir():
        for d in tmp_root.glob(PREFIX + "*"):
            shutil.rmtree(d, ignore_errors=True)
            done.append(f"removed {d}")
    return done


def peak_rss_mib() -> dict[str, float]:
    """Peak resident memory (``VmHWM``), summed per namespace, of the processes now in our namespaces: the
    file system's servers (srv) and each node's FUSE client (what the testbed costs in RAM)."""
    out = {}
    for name in existing():
        total = 0
        for pid in pids_in(name):
            try:
                for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if ln.startswith("VmHWM:"):
                        total += int(ln.split()[1])
            except OSError:
                continue
        out[name] = round(total / 1024, 1)
    return out
