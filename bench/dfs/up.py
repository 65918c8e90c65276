"""Bring a two-node distributed file system up by hand, or everything down.

    python bench/dfs/up.py gluster     # namespaces kvs-dfs-{srv,a,b}, GlusterFS, mounts /mnt/kvs-dfs-gluster-{a,b}
    python bench/dfs/up.py ceph        # the same with CephFS (mounts /mnt/kvs-dfs-ceph-{a,b})
    python bench/dfs/up.py down        # unmount, kill what runs in kvs-dfs-* namespaces, delete them, remove state

Needs root, /dev/fuse and ``ip netns``. Run a command on a node with
``nsenter -t $(pgrep -f 'sleep infinity' ...)`` or simply ``nsenter --net=/run/netns/kvs-dfs-a CMD``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dfs import netns, testbed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=[*testbed.FILE_SYSTEMS, "down"])
    ap.add_argument("--tmp", default="/var/tmp", help="where state folders go (a real disk; default /var/tmp)")
    args = ap.parse_args()
    why = netns.missing()
    if why:
        print(f"cannot run here: {why}", file=sys.stderr)
        return 2
    tmp = Path(args.tmp)
    # Under the testbed lock, held only while this command runs: a test session in progress holds it for its
    # whole run, so neither can pull the other's testbed away. A testbed left up by this command is owned by
    # hand ("manual" in the owner record): test sessions and benchmarks leave it alone; `down` removes it.
    fd = testbed.lock(timeout_s=5)
    try:
        return _do(args.what, tmp)
    finally:
        testbed.unlock(fd)


def _do(what: str, tmp: Path) -> int:
    if what == "down":  # by hand: whoever owns it (a crashed run, or a bed brought up by hand)
        for line in netns.clean_leftovers(tmp):
            print(line)
        testbed.OWNER_PATH.unlink(missing_ok=True)
        return 0
    if netns.existing():
        print(f"{testbed.describe(testbed.read_owner())} is up already: run `python bench/dfs/up.py down` first",
              file=sys.stderr)
        return 1
    testbed.claim(testbed.new_owner("manual"))
    timings = testbed.network_up(tmp)
    cluster = testbed.fs_up(what, tmp)
    print(json.dumps({"fs": cluster.name, "state": str(cluster.work),
                      "mounts": {n: str(p) for n, p in cluster.mounts.items()},
                      "timings_s": {**timings, **cluster.timings}}, indent=2))
    print(f"node shells: nsenter --net={netns.ns_path('a')} bash   (or kvs-dfs-b)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
