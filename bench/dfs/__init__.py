"""Real distributed file systems for the multi-node tests (issue 12): GlusterFS and CephFS servers in one
network namespace, a FUSE client per "node" namespace, and a worker that runs a kvstream store on a node.

Everything made here is named ``kvs-dfs-*`` (namespaces, links, mounts under ``/mnt``, temp folders), so the
leftover cleaner (:func:`bench.dfs.netns.clean_leftovers`) can find a crashed run's state without touching
anything else. ``python bench/dfs/up.py gluster|ceph|down`` does it by hand.
"""
