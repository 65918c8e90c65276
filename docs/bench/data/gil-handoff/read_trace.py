"""Kept as the record of a measurement (issue 20, 2026-12-06), not part of kvstream: per-read timings of one
`kvstream replay`, taken by wrapping the sans-I/O ReadStep's events (claim, opened, landed, checked) and the
store's close (host-memory buffer counters). Run as `kvstream replay` would be, e.g.

    flock /tmp/kvs-bench.lock env TRACE_OUT=log.json .venv/bin/python read_trace.py replay \
        --systems kvstream,bidaw-only --rounds 1 --switch-interval-ms 0 --json --out out > replay.json
    python3 read_trace.py --analyse log.json

The figures in BENCHMARKS §1.6 come from four such runs, --switch-interval-ms 0, 1, 1, 0.
"""
import json, sys, threading, time, os
import kvstream.read_step as rs
import kvstream.reader as rd
LOG = []
lock = threading.Lock()
cur = {"system": None}
def rec(*a):
    with lock:
        LOG.append((time.monotonic(), cur["system"]) + a)
_open = rs.ReadStep._open
def op(self, t, j, now, *a, **k):
    res = _open(self, t, j, now, *a, **k)
    rec("claim", id(self), res.read, t, j, len(self.chunks))
    return res
rs.ReadStep._open = op
for name in ("opened", "landed"):
    orig = getattr(rs.ReadStep, name)
    def w(self, rid, now, *a, _o=orig, _n=name, **k):
        r = self.reads.get(rid)
        rec(_n, id(self), rid, r.tier if r else -1, r.chunk if r else -1, a[0] if a else None)
        return _o(self, rid, now, *a, **k)
    setattr(rs.ReadStep, name, w)
origc = rs.ReadStep.checked
def ck(self, rid, now, ok):
    r = self.reads.get(rid)
    rec("checked", id(self), rid, r.tier if r else -1, r.chunk if r else -1, ok)
    return origc(self, rid, now, ok)
rs.ReadStep.checked = ck
oc = rs.ReadStep.close
def cl(self, now):
    rec("close", id(self), -1, -1, -1, None)
    return oc(self, now)
rs.ReadStep.close = cl
ost = rs.ReadStep.start
def st(self, now):
    rec("start", id(self), -1, -1, -1, len(self.chunks))
    return ost(self, now)
rs.ReadStep.start = st
# which system is running: wrap the replay's per-system runner
import kvstream.commands.replay as rp
import kvstream.store as so
oput = so.Store.put if hasattr(so.Store, "put") else None
# writes: record tier write completions via writer if possible
import kvstream.writer as wr
from kvstream.cli import main
# WIN_MIB=N: every tier's read window N MiB instead of read_inflight_bytes (the balanced windows then size the
# slower tier's from it): 100 gives the local tier two 48 MiB reads in flight.
W = int(os.environ.get("WIN_MIB", "0"))
if W:
    _make_windows = so.make_read_windows

    def _windows(policy, budgets, **k):
        return _make_windows(policy, [W << 20 for _ in budgets], **k)
    so.make_read_windows = _windows
import collections, statistics as S
def analyse(path):
  L=json.load(open(path))
  reads={}  # (step,rid)->dict
  for t,sysn,ev,step,rid,tier,ch,x in L:
      if ev in('claim','opened','landed','checked'):
          k=(step,rid); d=reads.setdefault(k,{'sys':sysn,'tier':tier,'ch':ch}); d[ev]=t
  def q(v,p): v=sorted(v); return v[min(len(v)-1,int(p*len(v)))] if v else float('nan')
  for sysn in sorted({d['sys'] for d in reads.values()}):
      if 'probe' in sysn: continue
      rs=[d for d in reads.values() if d['sys']==sysn]
      for tier in (0,1):
          r=[d for d in rs if d['tier']==tier and 'landed' in d]
          if not r: continue
          op=[d['opened']-d['claim'] for d in r]; io=[d['landed']-d['opened'] for d in r]
          ck=[d['checked']-d['landed'] for d in r if 'checked' in d]
          print(f"{sysn[-25:]:25s} tier{tier} n={len(r)} open p50 {q(op,.5)*1e3:.1f} p90 {q(op,.9)*1e3:.1f} p99 {q(op,.99)*1e3:.1f}ms | io p50 {q(io,.5)*1e3:.1f} p90 {q(io,.9)*1e3:.1f} p99 {q(io,.99)*1e3:.1f} | land->check p50 {q(ck,.5)*1e3:.1f} p90 {q(ck,.9)*1e3:.1f} p99 {q(ck,.99)*1e3:.1f} | sum open {sum(op):.2f}s io {sum(io):.2f}s")
      # concurrency: for each local io interval, fraction overlapped with a shared io interval
      loc=[(d['opened'],d['landed']) for d in rs if d['tier']==0 and 'landed' in d]
      sh=[(d['opened'],d['landed']) for d in rs if d['tier']==1 and 'landed' in d]
      if sh:
          alone=[];withs=[]
          for a,b in loc:
              ov=sum(max(0,min(b,d)-max(a,c)) for c,d in sh)
              (withs if ov>0.5*(b-a) else alone).append(b-a)
          print('   local io with shared in flight: n=%d p50 %.1f mean %.1f ms ; alone n=%d p50 %.1f mean %.1f ms'%(len(withs),q(withs,.5)*1e3,S.mean(withs)*1e3 if withs else 0,len(alone),q(alone,.5)*1e3,S.mean(alone)*1e3 if alone else 0))
      # local in-flight count distribution
      ev=sorted([(a,1) for a,b in loc]+[(b,-1) for a,b in loc])
      c=0;last=None;hist=collections.Counter()
      for t,dv in ev:
          if last is not None: hist[c]+=t-last
          c+=dv;last=t
      print('   local concurrent io time by depth', {k:round(v,2) for k,v in sorted(hist.items())})



# mark systems by watching Store construction order from replay's tier folder names
oinit = so.Store.__init__
import dataclasses


def sinit(self, *a, **k):
    # NOVERIFY=1: the systems' stores skip the payload checksum (verify_reads false; the probe's stores keep it)
    if os.environ.get('NOVERIFY') and a and 'replay-probe' not in str(a[0].tiers[0].path):
        a = (dataclasses.replace(a[0], verify_reads=False),) + a[1:]
    oinit(self, *a, **k)
    try:
        cur["system"] = "|".join(str(t.path) for t in self.config.tiers)
    except Exception:
        cur["system"] = "?"
    rec("store", 0, -1, -1, -1, cur["system"])
so.Store.__init__ = sinit
oclose = so.Store.close
def sclose(self, *a, **k):
    try:
        m = self.stats().memory
        rec("memstats", 0, -1, -1, -1, {"sys": cur["system"], **{f: getattr(m, f) for f in ("overflow_buffers", "overflow_reuses", "buffer_allocations", "buffer_reuses", "evictions", "hits")}})
    except Exception as e:
        rec("memstats", 0, -1, -1, -1, repr(e))
    return oclose(self, *a, **k)
so.Store.close = sclose
if sys.argv[1:2] == ['--analyse']:
    analyse(sys.argv[2])
    sys.exit(0)
rc = main(sys.argv[1:])
json.dump(LOG, open(os.environ.get("TRACE_OUT", "/tmp/trace/log.json"), "w"))
sys.exit(rc)
