#!/usr/bin/env bash
# Create .venv (if needed) and install kvstream with the extras a task needs.
#   scripts/setup.sh main   core + plots (what `kvstream replay` needs; `kvstream study reuse` also needs [study])
#   scripts/setup.sh test   everything the test suite needs: + pytest/hypothesis, torch 2.13.0 (CPU), LMCache 0.5.6,
#                           and .venv-lmcache-pins: .venv with LMCache 0.5.6's pinned numpy/prometheus_client
#   scripts/setup.sh dfs    (root) GlusterFS, Ceph and xfsprogs from apt for the root suites, if missing
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-main}"
PY="${PYTHON:-python3}"
# pip 22.3 or later can install into another interpreter's environment (pip --python).
pip_can_target() {
  "$PY" -m pip --version 2>/dev/null | awk '{split($2, v, "."); exit !(v[1] > 22 || (v[1] == 22 && v[2] >= 3))}'
}
if [ "$what" != dfs ] && [ ! -x .venv/bin/python ]; then
  # Where this Python has such a pip, .venv is made without one and the first install below puts pip in it with
  # everything else: venv's own ensurepip compiles all of pip and took 6 s of make demo's budget, this takes 2.
  # Otherwise the pip a Python >= 3.11 venv comes with (22.3 or later) installs everything here, editable included.
  if pip_can_target; then
    "$PY" -m venv --without-pip .venv
  else
    "$PY" -m venv .venv
  fi
fi
pip() {
  if .venv/bin/python -c 'import pip' 2>/dev/null; then
    .venv/bin/python -m pip "$@"
  elif [ "$1" = install ]; then
    shift
    "$PY" -m pip --python .venv/bin/python install pip "$@"
  else
    echo "scripts/setup.sh: .venv has no pip; run: .venv/bin/python -m ensurepip" >&2
    exit 1
  fi
}
# A second run with nothing changed skips pip (its editable reinstall alone took 25 s, a twelfth of `make demo`'s
# budget): the stamp names this checkout, the interpreter and every file that decides what gets installed.
stamp=".venv/.kvstream-setup-$what"
stamp_key() {
  { pwd; .venv/bin/python -c 'import sys; print(sys.version)'; cat pyproject.toml scripts/setup.sh scripts/lmcache_pins.py; } \
    | sha256sum | cut -d' ' -f1
}
if [ "$what" != dfs ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(stamp_key)" ] \
   && .venv/bin/python -c 'import kvstream' 2>/dev/null; then
  exit 0
fi
case "$what" in
  main)
    # scipy ([study]) added 9 s to make demo's install, for one study only. --no-compile: Python compiles what
    # a run imports, on first import, instead of pip compiling every module of every wheel (3.4 s of make demo).
    pip install -q --no-compile -e '.[plot]'
    ;;
  test)
    # torch first, pinned: LMCache's native modules are built against exactly this release, and this
    # release's CPU wheel is available locally on these machines (any other pulls gigabytes of CUDA wheels).
    pip install -q 'torch==2.13.0'
    pip install -q -e '.[study,plot,test,lmcache]'
    # LMCache's own metadata pulls CUDA-only wheels and may replace torch: install it without dependencies
    # (its import-time needs are the [lmcache] extra above).
    pip install -q --no-deps 'lmcache==0.5.6'
    # --no-deps also means LMCache's pins are never applied: .venv gets the newest numpy and prometheus_client,
    # which LMCache 0.5.6 excludes (numpy<=2.2.6, prometheus_client<=0.24.1). .venv-lmcache-pins is a second venv
    # layered on .venv (a .pth adds .venv's site-packages after its own) holding, at LMCache's pins, each installed
    # distribution whose version breaks them (scripts/lmcache_pins.py reads them from LMCache's metadata);
    # scripts/test.sh runs the plugin's tests there too. Cheap: a few wheels, no second torch.
    PINS=.venv-lmcache-pins
    if [ ! -x "$PINS/bin/python" ]; then
      "$PY" -m venv "$PINS"
    fi
    main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    pins_site=$("$PINS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # addsitedir (not a bare path line): .venv's own .pth files (the editable kvstream) are read too
    echo "import site; site.addsitedir('$main_site')" > "$pins_site/zz-kvstream-main-venv.pth"
    .venv/bin/python scripts/lmcache_pins.py > "$PINS/pins.txt"
    if [ -s "$PINS/pins.txt" ]; then
      "$PINS/bin/python" -m pip install -q -r "$PINS/pins.txt"
    fi
    ;;
  dfs)
    # The file systems of the multi-node suite (tests/root/test_dfs_multinode.py, bench/dfs): GlusterFS and Ceph,
    # from the distribution. Root only (the suite needs root anyway and skips without it); installs only what
    # is missing, so a second run costs one dpkg-query. No daemon is started here: the tests start their own,
    # in network namespaces, and stop them.
    if [ "$(id -u)" -ne 0 ]; then
      echo "scripts/setup.sh dfs: not root, nothing installed (the dfs tests skip without root)" >&2
      exit 0
    fi
    installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
    plain=(); norec=()
    # xfsprogs and util-linux: the fault suite's XFS shutdown and fsfreeze drills (tests/root/test_fault_suite_root.py).
    for p in glusterfs-server glusterfs-client xfsprogs; do installed "$p" || plain+=("$p"); done
    command -v ip >/dev/null || plain+=(iproute2)
    # Ceph without recommends: those pull in hundreds of MB (dashboards, python stacks) the tests never use.
    for p in ceph-mon ceph-osd ceph-mds ceph-mgr ceph-fuse ceph-common; do installed "$p" || norec+=("$p"); done
    if [ ${#plain[@]} -gt 0 ] || [ ${#norec[@]} -gt 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -q
      [ ${#plain[@]} -eq 0 ] || apt-get install -y -q "${plain[@]}"
      [ ${#norec[@]} -eq 0 ] || apt-get install -y -q --no-install-recommends "${norec[@]}"
    fi
    ;;
  *)
    echo "usage: scripts/setup.sh [main|test|dfs]" >&2
    exit 2
    ;;
esac
if [ "$what" != dfs ]; then
  stamp_key > "$stamp"
fi
