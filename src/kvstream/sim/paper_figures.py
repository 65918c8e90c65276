"""The paper figures issue 15 added to ``kvstream simulate``: K4 with recompute, K8 with correlated bursts, K9,
K16, B9, and B3 revisited. Each prints the paper's figure beside its own, like :mod:`kvstream.sim.scenarios`
(which imports this module at its end, so the scenarios register in the same table).

Hardware and systems come from :mod:`kvstream.sim.scenarios`; the workloads from :mod:`kvstream.workload`
(:mod:`~kvstream.workload.agent`, :mod:`~kvstream.workload.sharegpt`, :mod:`~kvstream.workload.arrivals`).
Invariant: nothing here hard-codes a measured figure; every "ours" column is computed by the run, and a
verdict compares it with the paper's figure by a rule written next to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstream.sim.driver import Hardware, SystemConfig, TierModel, simulate
from kvstream.sim.scenarios import (
    GB,
    SCENARIOS,
    Row,
    ScenarioResult,
    _capacity,
    _pct,
    _plt,
    bidaw_systems,
    largest_passing,
    session_setup,
    kvstream,
    lmcache,
    offline_documents,
    online_sessions,
    scenario,
    testbed_tiers,
    within,
)
from kvstream.workload.agent import AGENT_PRESETS, agent_sessions
from kvstream.workload.arrivals import lag1_autocorr, sample_cv
from kvstream.workload.request import Request
from kvstream.workload.sharegpt import ShareGPTSpec, sharegpt_requests
from kvstream.workload.synthetic import reuse_rate

__all__ = ["memory_only", "agent_workload", "sharegpt_workload"]


def memory_only(tiers: Sequence[TierModel], host: float) -> SystemConfig:
    """The paper's "memory only" baseline: GPU and host memory, every other miss recomputed (tiers never read)."""
    return kvstream(tiers, host, name="memory only").replace(read_disk=False)


def _save(fig: Any, out: Path, name: str) -> str:
    png = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    _plt().close(fig)
    return png.name


# ===========================================================================================================
def agent_workload(rate: float, *, quick: bool, seed: int) -> list[Request]:
    """SWE-bench-like agent sessions (:data:`kvstream.workload.agent.AGENT_PRESETS` ``swe-bench``) at ``rate``
    new tasks per second; 200 tasks (40 quick)."""
    return agent_sessions(AGENT_PRESETS["swe-bench"].replace(session_rate=rate, n_sessions=40 if quick else 200), seed)


@scenario("agent", "K9", "coding-agent sessions (SWE-bench-like): share of requests with TTFT <= 1 s")
def sc_agent(out: Path, quick: bool, seed: int) -> ScenarioResult:
    # 32B on 4x H100, testbed 1; host memory 40 GB per GPU (the paper's default for its online agent runs, K12),
    # so the live sessions' KV (hundreds of GB) spills to disk.
    hw = Hardware(gpu="h100", model="32b")
    tiers = testbed_tiers(1)
    host = 160 * GB
    # Task rates around the knee where LMCache's share falls through 70 % (the paper's operating point): below it
    # every system meets 1 s, above it the GPU saturates and every system misses.
    rates = [0.15, 0.175] if quick else [0.125, 0.15, 0.1625, 0.17, 0.175, 0.1875, 0.2]
    systems = {"LMCache": lmcache(tiers, host), "KVStream": kvstream(tiers, host), "memory only": memory_only(tiers, host)}
    data: dict[str, Any] = {"rates": {}}
    for rate in rates:
        reqs = agent_workload(rate, quick=quick, seed=seed)
        row: dict[str, Any] = {"requests": len(reqs), "reuse": reuse_rate(reqs)}
        for name, sysc in systems.items():
            s_ = simulate([reqs], sysc, hw, seed=seed, slo_s=1.0).summary
            row[name] = {"slo": s_["slo_attainment"], "ttft": s_["ttft_mean_s"], "disk": s_["hit_disk"]}
        data["rates"][rate] = row
    # The headline: the measured load at which LMCache's share is nearest the paper's 70 %.
    head = min(rates, key=lambda r: abs(data["rates"][r]["LMCache"]["slo"] - 0.70))
    h = data["rates"][head]
    data["headline_rate"] = head
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name in systems:
        ax.plot(rates, [100 * data["rates"][r][name]["slo"] for r in rates], "o-", label=f"{name} (this sim)")
    ax.axhline(84, color="C1", ls=":", label="KVStream, paper (84 %)")
    ax.axhline(70, color="C0", ls=":", label="LMCache, paper (70 %)")
    ax.set_xlabel("new agent tasks per second")
    ax.set_ylabel("requests with TTFT <= 1 s (%)")
    ax.set_title("K9: SWE-bench-like agent, 32B, testbed 1, 160 GB host")
    ax.legend(fontsize=7)
    fig_name = _save(fig, out, "agent")
    kv, lm, mo = h["KVStream"]["slo"], h["LMCache"]["slo"], h["memory only"]["slo"]
    order = ("KVStream", "LMCache", "memory only")  # the order the row's columns name
    curve = "; ".join(f"{r:g}/s: " + " / ".join(f"{100 * data['rates'][r][n]['slo']:.0f}" for n in order)
                      for r in rates)
    rows = [
        Row("K9", "TTFT <= 1 s: KVStream / LMCache / others", "84 % / 70 % / < 55 %",
            f"{_pct(kv)} / {_pct(lm)} / memory only {_pct(mo)} (at {head:g} tasks/s)",
            "reproduced" if abs(kv - 0.84) <= 0.10 and abs(lm - 0.70) <= 0.10 and mo < lm else "not reproduced",
            note=f"KVStream / LMCache / memory only (%) by task rate: {curve}. Mooncake store and HiCache are not "
                 "modelled; the headline is the measured load where LMCache is nearest the paper's 70 %"),
        Row("K9", "workload: prompt chunks that hit (unlimited cache)", "80-96 %", _pct(h["reuse"]),
            "reproduced" if 0.80 <= h["reuse"] <= 0.96 else "not reproduced"),
    ]
    return ScenarioResult(name="agent", title=SCENARIOS["agent"].title, rows=rows, figures=[fig_name],
                          setup=f"{h['requests']} requests from {40 if quick else 200} agent tasks (2k system prompt, "
                                "4k task, ~20 turns of 1k-token tool output and 150-token tool calls, tool runs ~15 s); "
                                "Qwen2.5-32B on 4x H100, testbed 1, 160 GB host memory", data=data)


# ===========================================================================================================
@scenario("output", "K16", "offline throughput vs LMCache as the output grows from 16 to 256 tokens")
def sc_output(out: Path, quick: bool, seed: int) -> ScenarioResult:
    n_docs, q = (24, 4) if quick else (150, 8)
    outputs = [16, 256] if quick else [16, 32, 64, 128, 256]
    hw = Hardware(gpu="h100", model="32b")
    tiers = testbed_tiers(1)
    host = (64 if quick else 512) * GB
    data: dict[int, Any] = {}  # output tokens -> figures
    for o in outputs:
        wl = offline_documents(n_docs, q, seed=seed, output=o)
        b = simulate([wl.requests], lmcache(tiers, host), hw, seed=seed, prewarm=[wl.docs]).summary
        k = simulate([wl.requests], kvstream(tiers, host), hw, seed=seed, prewarm=[wl.docs]).summary
        data[o] = {"speedup": k["throughput_rps"] / b["throughput_rps"],
                   "lmcache_read_share": b["storage_read_s"] / b["makespan_s"]}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(outputs, [data[o]["speedup"] for o in outputs], "o-", label="this sim")
    ax.axhspan(1.19, 1.37, color="C1", alpha=0.2, label="paper (1.19-1.37x)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("output tokens per request (mean)")
    ax.set_ylabel("throughput vs LMCache")
    ax.set_title("K16: LooGLE-like, 32B, testbed 1")
    ax.legend(fontsize=7)
    fig_name = _save(fig, out, "output")
    sp = [data[o]["speedup"] for o in outputs]
    falls = all(a >= b for a, b in zip(sp, sp[1:]))
    rows = [Row("K16", f"throughput vs LMCache, output {outputs[0]} -> {outputs[-1]}", "1.19-1.37x",
                " / ".join(f"{o}: {data[o]['speedup']:.2f}x" for o in outputs),
                "reproduced" if falls and within(sp[0], 1.37, 0.25) and within(sp[-1], 1.19, 0.25) else "not reproduced",
                note="the gain falls as decoding takes a larger share of each step (LMCache reads "
                     + " / ".join(f"{100 * data[o]['lmcache_read_share']:.0f}" for o in outputs) + " % of its time)")]
    return ScenarioResult(name="output", title=SCENARIOS["output"].title, rows=rows, figures=[fig_name],
                          setup=f"{n_docs} docs x {q} questions (24k tokens) on disk beforehand, all at t=0; Qwen2.5-32B "
                                f"on 4x H100, testbed 1, {host / GB:.0f} GB host memory; output mean swept", data=data)


# ===========================================================================================================
@scenario("model-size", "K4", "offline throughput vs LMCache by model size, uncached prefixes recomputed")
def sc_model_size(out: Path, quick: bool, seed: int) -> ScenarioResult:
    # Cold start: no document is on disk beforehand, so each document's first question computes (prefills) it
    # and stores it; later questions find it in HBM, host memory or on disk. Two set sizes: one whose 14B KV
    # fits the 512 GB of host memory (the paper's first reason for the growth: bigger KV, fewer prefixes in
    # memory), and the ablation scenario's larger set, which no model's KV fits.
    sets = {"fits at 14B": (100, 12), "ablation's set": (150, 8)} if not quick else {"quick": (16, 6)}
    models = ["14b", "70b"] if quick else ["14b", "32b", "70b", "110b"]
    tiers = testbed_tiers(1)
    host = (16 if quick else 512) * GB
    data: dict[str, Any] = {}
    for label, (n_docs, q) in sets.items():
        data[label] = {}
        wl = offline_documents(n_docs, q, seed=seed)
        for m in models:
            hw = Hardware(gpu="h100", model=m)
            b = simulate([wl.requests], lmcache(tiers, host), hw, seed=seed).summary
            k = simulate([wl.requests], kvstream(tiers, host), hw, seed=seed).summary
            r = simulate([wl.requests], memory_only(tiers, host), hw, seed=seed).summary
            data[label][m] = {"speedup": k["throughput_rps"] / b["throughput_rps"],
                              "lmcache_vs_recompute": b["throughput_rps"] / r["throughput_rps"],
                              "lmcache_read_share": b["storage_read_s"] / b["makespan_s"], "disk_hit": b["hit_disk"]}
    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for label in sets:
        ax[0].plot(models, [data[label][m]["speedup"] for m in models], "o-", label=f"KVStream / LMCache, {label}")
        ax[1].plot(models, [data[label][m]["lmcache_vs_recompute"] for m in models], "o-", label=label)
    ax[0].axhline(1.49, color="C1", ls=":", label="paper, best (1.49x)")
    ax[0].set_ylabel("throughput vs LMCache")
    ax[0].set_title("K4: cold documents, testbed 1")
    ax[0].legend(fontsize=7)
    ax[1].axhline(2.2, color="C1", ls=":", label="paper: reading beats recompute by up to 2.2x")
    ax[1].set_ylabel("LMCache / memory only (recompute)")
    ax[1].set_title("reading vs recomputing")
    ax[1].legend(fontsize=7)
    fig_name = _save(fig, out, "model-size")
    rows = []
    for label in sets:
        sp = {m: data[label][m]["speedup"] for m in models}
        grows = sp[models[-1]] > sp[models[0]]
        rows.append(Row("K4", f"throughput vs LMCache by size, {label}", "up to 1.49x, growing with size",
                        " / ".join(f"{m} {v:.2f}x" for m, v in sp.items()),
                        "reproduced" if grows and max(sp.values()) >= 1.49 * 0.85 else
                        ("trend only" if grows else "not reproduced"),
                        note="disk share of chunks (LMCache) " + " / ".join(
                            f"{data[label][m]['disk_hit']:.2f}" for m in models)))
        rc = {m: data[label][m]["lmcache_vs_recompute"] for m in models}
        rows.append(Row("K4", f"reading (LMCache) vs recomputing, {label}", "up to 2.2x on large models",
                        " / ".join(f"{m} {v:.2f}x" for m, v in rc.items()),
                        "reproduced" if rc[models[-1]] > rc[models[0]] and within(max(rc.values()), 2.2, 0.25)
                        else "not reproduced"))
    return ScenarioResult(name="model-size", title=SCENARIOS["model-size"].title, rows=rows, figures=[fig_name],
                          setup="LooGLE-like questions (24k-token documents), all at t=0, no document cached beforehand; "
                                f"4x H100, testbed 1, {host / GB:.0f} GB host memory; sets: "
                                + ", ".join(f"{k} = {n} docs x {q}" for k, (n, q) in sets.items()), data=data)


# ===========================================================================================================
@scenario("burst-mmpp", "K8", "mean TTFT vs LMCache with correlated bursts (MMPP arrivals) instead of a renewal process")
def sc_burst_mmpp(out: Path, quick: bool, seed: int) -> ScenarioResult:
    # The 'burst' scenario's set-up exactly (same sessions, lengths and rate); only the arrival process changes.
    n, hw, tiers, host, active = session_setup(quick)
    probe = online_sessions(n, seed=seed, rate=1.0, cv=1.0, active=active)
    cap = _capacity(probe, lmcache(tiers, host), hw, seed)
    # KVStream's own capacity bounds what any arrival process can show: a burst above both capacities queues
    # in both systems, and the queues then drain at the ratio of the capacities.
    cap_kv = _capacity(probe, kvstream(tiers, host), hw, seed)
    cvs = [4.0, 8.0] if quick else [2.0, 4.0, 6.0, 8.0]
    data: dict[str, Any] = {"lmcache_capacity_rps": cap, "kvstream_capacity_rps": cap_kv, "mmpp": {}, "gamma": {}}
    for kind in ("mmpp", "gamma"):
        for cv in (cvs if kind == "mmpp" else [4.0, 8.0]):
            reqs = online_sessions(n, seed=seed, rate=0.85 * cap, cv=cv, active=active, arrival=kind)
            gaps = np.diff([r.arrival for r in reqs])
            b = simulate([reqs], lmcache(tiers, host), hw, seed=seed).summary["ttft_mean_s"]
            k = simulate([reqs], kvstream(tiers, host), hw, seed=seed).summary["ttft_mean_s"]
            data[kind][cv] = {"lmcache": b, "kvstream": k, "speedup": b / k, "sample_cv": sample_cv(gaps),
                              "lag1": lag1_autocorr(gaps)}
    # Load sensitivity at CV 4: the gain grows fast once the load passes LMCache's capacity (KVStream's is higher).
    loads = [] if quick else [0.95, 1.0, 1.05]
    data["load_cv4"] = {}
    for f in loads:
        reqs = online_sessions(n, seed=seed, rate=f * cap, cv=4.0, active=active, arrival="mmpp")
        b = simulate([reqs], lmcache(tiers, host), hw, seed=seed).summary["ttft_mean_s"]
        k = simulate([reqs], kvstream(tiers, host), hw, seed=seed).summary["ttft_mean_s"]
        data["load_cv4"][f] = {"lmcache": b, "kvstream": k, "speedup": b / k}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for kind, style in (("mmpp", "o-"), ("gamma", "s--")):
        xs = sorted(data[kind])
        ax.plot(xs, [data[kind][c]["speedup"] for c in xs], style, label=f"{kind} arrivals (this sim)")
    ax.plot([4, 8], [6.07, 1.17], "k^", label="paper")
    ax.set_xlabel("CV of inter-arrival gaps")
    ax.set_ylabel("mean TTFT, LMCache / KVStream")
    ax.set_title("K8: correlated bursts (32B, testbed 1, 0.85 x capacity)")
    ax.legend(fontsize=7)
    fig_name = _save(fig, out, "burst-mmpp")
    m4, m8 = data["mmpp"][4.0], data["mmpp"][8.0]
    g4, g8 = data["gamma"][4.0], data["gamma"][8.0]
    rows = [
        Row("K8", "mean TTFT vs LMCache at CV 4, MMPP", "6.07x", f"{m4['speedup']:.2f}x (gamma renewal {g4['speedup']:.2f}x)",
            "reproduced" if within(m4["speedup"], 6.07, 0.25) else "not reproduced",
            note=f"LMCache / KVStream mean TTFT {m4['lmcache']:.2f} / {m4['kvstream']:.2f} s; gaps' lag-1 autocorrelation "
                 f"{m4['lag1']:.2f} (gamma {g4['lag1']:.2f})"),
        Row("K8", "mean TTFT vs LMCache at CV 8, MMPP", "1.17x", f"{m8['speedup']:.2f}x (gamma renewal {g8['speedup']:.2f}x)",
            "reproduced" if within(m8["speedup"], 1.17, 0.25) else "not reproduced",
            note="MMPP by CV: " + " / ".join(f"CV {c:g}: {data['mmpp'][c]['speedup']:.2f}x" for c in cvs)),
        Row("K8", "capacity (all requests queued at once), KVStream / LMCache", "(not stated)",
            f"{cap_kv / cap:.2f}x ({cap_kv:.2f} vs {cap:.2f} req/s)", "info",
            note="bursts at CV 4 exceed both capacities, so both systems queue and drain at about this ratio"),
    ]
    if loads:
        lc = data["load_cv4"]
        rows.append(Row("K8", "CV 4 (MMPP) at higher load, x LMCache's capacity", "6.07x (load not stated)",
                        " / ".join(f"{f:g}: {lc[f]['speedup']:.2f}x" for f in loads), "info",
                        note="past LMCache's capacity (and below KVStream's) LMCache's queue grows without bound: the "
                             "ratio then depends on the run's length"))
    return ScenarioResult(name="burst-mmpp", title=SCENARIOS["burst-mmpp"].title, rows=rows, figures=[fig_name],
                          setup=f"as 'burst': {n} session requests at 0.85 x LMCache's capacity ({cap:.2f} req/s); "
                                "arrivals from a two-state MMPP fitted to each CV (kvstream.workload.arrivals)",
                          data=data)


# ===========================================================================================================
def sharegpt_workload(user_rate: float, *, quick: bool, seed: int, gap_s: float = 60.0) -> list[Request]:
    """ShareGPT-like conversations with Poisson timestamps (:mod:`kvstream.workload.sharegpt`): 1500 users (300
    quick) arriving at ``user_rate`` per second, exponential gaps of mean ``gap_s`` between a user's rounds."""
    return sharegpt_requests(ShareGPTSpec(n_users=300 if quick else 1500, user_rate=user_rate, gap_mean_s=gap_s), seed)


def _max_rate(system: SystemConfig, hw: Hardware, target: float, *, quick: bool, seed: int, lo: float, hi: float,
              iters: int) -> float:
    """Largest user arrival rate at which the mean TTFT stays within ``target``."""
    def ok(rate: float) -> bool:
        ttft: float = simulate([sharegpt_workload(rate, quick=quick, seed=seed)], system, hw, seed=seed).summary["ttft_mean_s"]
        return ttft <= target

    return largest_passing(ok, lo, hi, iters)


@scenario("sharegpt", "B9", "Bidaw vs FlashGen on ShareGPT-like conversations with Poisson timestamps")
def sc_sharegpt(out: Path, quick: bool, seed: int) -> ScenarioResult:
    hw = Hardware(gpu="a800", model="opt-13b", tp=1)
    systems = bidaw_systems(200 * GB)
    names = ("CachedAttention", "FlashGen", "Bidaw")
    # ShareGPT has no timestamps, so the time between a user's rounds is a free parameter: 60 s (about the Bidaw
    # trace's own 48 s mean) and 300 s (five times as many live conversations: host memory overflows to disk).
    # With 300 s gaps 1500 users never load the GPU to its knee, so the throughput bisection runs on 60 s only.
    variants = ({"60 s gaps": (60.0, [0.75, 1.0])} if quick else
                {"60 s gaps": (60.0, [0.75, 1.0, 1.1, 1.2, 1.3]), "300 s gaps": (300.0, [1.0, 1.6])})
    lat: dict[str, dict[float, dict[str, dict[str, float]]]] = {}
    for label, (gap, rates) in variants.items():
        lat[label] = {}
        for rate in rates:
            reqs = sharegpt_workload(rate, quick=quick, seed=seed, gap_s=gap)
            lat[label][rate] = {}
            for name in names:
                s_ = simulate([reqs], systems[name], hw, seed=seed).summary
                lat[label][rate][name] = {"ttft": s_["ttft_mean_s"], "host_hit": s_["hit_host"], "disk": s_["hit_disk"]}
    target = 2.0  # mean TTFT, as the 'bidaw' scenario's B2
    thr = {} if quick else {n: _max_rate(systems[n], hw, target, quick=quick, seed=seed, lo=0.5, hi=2.0, iters=6)
                            for n in names}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for k, (label, by_rate) in enumerate(lat.items()):
        rates = list(by_rate)
        for j, name in enumerate(names):
            ax.plot(rates, [by_rate[r][name]["ttft"] for r in rates], "o-" if k == 0 else "s--", color=f"C{j}",
                    label=f"{name}, {label}")
    ax.set_yscale("log")
    ax.set_xlabel("new users per second")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("B9: ShareGPT-like, OPT-13B, A800, 200 GB host, 1.5 GB/s SSD")
    ax.legend(fontsize=6)
    fig_name = _save(fig, out, "sharegpt")
    rows = []
    for label, by_rate in lat.items():
        rates = list(by_rate)
        red = {r: 1 - by_rate[r]["Bidaw"]["ttft"] / by_rate[r]["FlashGen"]["ttft"] for r in rates}
        best = max(rates, key=lambda r: red[r])
        rows.append(Row("B9", f"latency vs FlashGen, best rate, {label}", "up to -56.9 %",
                        f"{_pct(-red[best])} at {best:g} users/s",
                        "reproduced" if within(red[best], 0.569, 0.25) else "not reproduced",
                        note="by rate: " + " / ".join(f"{r:g}: {_pct(-red[r])}" for r in rates)
                             + "; FlashGen mean TTFT (s) " + " / ".join(f"{by_rate[r]['FlashGen']['ttft']:.2f}" for r in rates)
                             + "; disk share of chunks (FlashGen) "
                             + " / ".join(f"{by_rate[r]['FlashGen']['disk']:.2f}" for r in rates)
                             + "; host hit rate FlashGen / Bidaw at the best rate "
                             + f"{by_rate[best]['FlashGen']['host_hit']:.2f} / {by_rate[best]['Bidaw']['host_hit']:.2f}"))
    if thr:
        rows.insert(0, Row("B9", f"throughput (users/s at mean TTFT <= {target:g} s) vs FlashGen, 60 s gaps", "1.40x",
                           f"{thr['Bidaw'] / thr['FlashGen']:.2f}x ({thr['Bidaw']:.2f} vs {thr['FlashGen']:.2f} users/s; "
                           f"CachedAttention {thr['CachedAttention']:.2f})",
                           "reproduced" if within(thr["Bidaw"] / thr["FlashGen"], 1.40, 0.25) else "not reproduced"))
    n_req = len(sharegpt_workload(1.0, quick=quick, seed=seed))
    return ScenarioResult(name="sharegpt", title=SCENARIOS["sharegpt"].title, rows=rows, figures=[fig_name],
                          setup=f"{n_req} requests from {300 if quick else 1500} ShareGPT-like conversations (Poisson user "
                                "arrivals, exponential gaps between a user's rounds, 70-token questions, 200-token answers, "
                                "ended at OPT's 2048-token context); OPT-13B on one A800, 200 GB host memory, one 1.5 GB/s "
                                "SSD tier", data={"latency": lat, "throughput_rate": thr})


# ===========================================================================================================
GIB = 1 << 30


def _reduction(ours: float, base: float) -> float:
    """Relative miss-rate reduction ``1 - ours / base`` (NaN when the baseline has no misses)."""
    return 1 - ours / base if base and math.isfinite(base) else math.nan


@scenario("b3", "B3", "host-memory miss rate: hit potential vs queue-aware and FIFO/LRU/LFU on the Bidaw trace, by load")
def sc_b3(out: Path, quick: bool, seed: int) -> ScenarioResult:
    """A cache-only replay (:mod:`kvstream.study.cache_replay`), not a timed simulation: all four trace parts, the
    authors' settings (30 % of the users, OPT-13B's K,V at 800 KiB per token capped at its 2048-token context, a
    conversation's KV dropped after its last round, queue-aware sees the next 30 requests) at 200 GiB and at
    lighter loads (more memory for the same users), plus full load at 200 GiB. Deterministic: ``seed`` is unused."""
    from kvstream.eviction import HitPotentialConfig
    from kvstream.models import get_model, kv_bytes_per_token
    from kvstream.sim.scenarios import BIDAW_TRACES
    from kvstream.study.cache_replay import ReplayResult, build_accesses, replay
    from kvstream.workload.bidaw import read_bidaw_trace

    if not BIDAW_TRACES.exists():
        raise FileNotFoundError(f"the Bidaw trace is not at {BIDAW_TRACES}")
    bpt = kv_bytes_per_token(get_model("opt-13b"))  # kvstream.models' own shape (the cost model's view has the same K,V)
    trace = read_bidaw_trace(BIDAW_TRACES)
    if quick:  # one part, a tenth of its users: the code path, not the figure
        trace = trace.select(trace.part == 0).sample_users(0.1)
    policies = ("fifo", "lru", "lfu", "queue-aware", "hit-potential", "belady")
    # The paper's ghost cache: 40 GB buckets from the memory size (200 GB) to 480 GB, then "extreme". In units of
    # the capacity C that is 7 buckets over 1.4 C.
    paper_buckets = HitPotentialConfig(promising_buckets=7, promising_span=1.4)
    # (share of users, GiB): the authors' setting first; quick shrinks memory with the trace so misses remain.
    loads = [(0.3, 2)] if quick else [(0.3, 200), (0.3, 240), (0.3, 280), (0.3, 320), (1.0, 200)]
    data: dict[str, Any] = {}
    for frac, gib in loads:
        t = trace.sample_users(frac) if frac < 1 else trace
        stream = build_accesses(t, bytes_per_token=bpt, context_cap=2048)
        cap = int(gib * GIB)
        pols = policies if frac < 1 else ("queue-aware", "hit-potential", "belady")
        res: dict[str, ReplayResult] = {p: replay(stream, p, cap) for p in pols}
        if (frac, gib) == loads[0]:
            res["hit-potential, paper buckets"] = replay(stream, "hit-potential", cap, hp_config=paper_buckets)
        key = f"{int(frac * 100)} % users, {gib} GiB"
        d: dict[str, Any] = {"miss": {p: r.miss_rate for p, r in res.items()},
                             "byte_miss": {p: r.byte_miss_rate for p, r in res.items()},
                             "ghost": res["hit-potential"].extra, "accesses": res["queue-aware"].accesses}
        for w in ("miss", "byte_miss"):
            m = d[w]
            generic = [m[p] for p in ("fifo", "lru", "lfu") if p in m]
            g = float(np.mean(generic)) if generic else math.nan
            d[f"{w}_vs"] = {p: {"qa": _reduction(m[p], m["queue-aware"]), "generic": _reduction(m[p], g)}
                            for p in m if p.startswith(("hit-potential", "belady"))}
        data[key] = d
    keys = list(data)
    first = data[keys[0]]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    thinned = [k for k in keys if k.startswith("30")]
    for p, style in (("hit-potential", "o-"), ("belady", "s--")):
        ax.plot(range(len(thinned)), [-100 * data[k]["miss_vs"][p]["qa"] for k in thinned], style, label=f"{p} vs queue-aware")
        ax.plot(range(len(thinned)), [-100 * data[k]["miss_vs"][p]["generic"] for k in thinned], style, alpha=0.5,
                label=f"{p} vs FIFO/LRU/LFU")
    ax.axhline(-57.6, color="C1", ls=":", label="paper vs queue-enhanced (-57.6 %)")
    ax.axhline(-69.9, color="C3", ls=":", label="paper vs FIFO/LRU/LFU (-69.9 %)")
    ax.set_xticks(range(len(thinned)), [k.split(", ")[1] for k in thinned])
    ax.set_xlabel("host memory, 30 % of the users of all four parts")
    ax.set_ylabel("miss-rate change (%)")
    ax.set_title("B3: Bidaw trace, cache-only replay")
    ax.legend(fontsize=6)
    fig_name = _save(fig, out, "b3")
    vs = first["miss_vs"]
    met = [k for k in thinned if data[k]["miss_vs"]["hit-potential"]["qa"] >= 0.576]
    rows = [
        Row("B3", "miss rate, hit potential vs queue-aware", "-57.6 %",
            f"{_pct(-vs['hit-potential']['qa'])} ({keys[0]}; Belady {_pct(-vs['belady']['qa'])})",
            "reproduced" if within(vs["hit-potential"]["qa"], 0.576, 0.25) else "not reproduced",
            note="by load: " + " / ".join(f"{k}: {_pct(-data[k]['miss_vs']['hit-potential']['qa'])} "
                                          f"(Belady {_pct(-data[k]['miss_vs']['belady']['qa'])})" for k in keys)
                 + (f"; the paper's figure is first met at {met[0]}" if met else "; the paper's figure is not met")),
        Row("B3", "miss rate, hit potential vs FIFO/LRU/LFU (mean)", "-69.9 %",
            f"{_pct(-vs['hit-potential']['generic'])} (Belady {_pct(-vs['belady']['generic'])})",
            "reproduced" if within(vs["hit-potential"]["generic"], 0.699, 0.25) else "not reproduced",
            note="by load: " + " / ".join(f"{k}: {_pct(-data[k]['miss_vs']['hit-potential']['generic'])}"
                                          for k in thinned)),
        Row("B3", "the paper's ghost-cache buckets (7 x 40 GB from 200 GB)", "(the paper's setting)",
            f"{_pct(-vs['hit-potential, paper buckets']['qa'])} vs queue-aware (default buckets "
            f"{_pct(-vs['hit-potential']['qa'])})", "info",
            note="the default buckets are already 40 GB (0.2 C) wide from C; they only run on to 3 C, where the ghost "
                 "cache's hit rates are 0"),
        Row("B3", "weighted by KV bytes instead of requests", "(not stated)",
            f"{_pct(-first['byte_miss_vs']['hit-potential']['qa'])} vs queue-aware, "
            f"{_pct(-first['byte_miss_vs']['hit-potential']['generic'])} vs FIFO/LRU/LFU", "info"),
    ]
    return ScenarioResult(name="b3", title=SCENARIOS["b3"].title, rows=rows, figures=[fig_name],
                          setup="Bidaw trace parts 1, 3, 6, 7 (" + ("part 1, 10 % of users: quick" if quick else
                                "the authors' 30 % of users, and all users") + "), OPT-13B K,V (800 KiB/token, capped at "
                                "2048 tokens), finished conversations dropped, queue-aware look-ahead 30", data=data)
