"""``kvstream study``: reproduce Bidaw's trace observations on the conversation trace.

- ``study eviction``: replay the KV accesses against the host-memory tier alone (no I/O) for each eviction policy
  and memory size; hit and miss rates, Bidaw's miss-rate reductions (TARGETS B3) beside the paper's, and the
  compact-tensor space figure for the model (B8).
- ``study reuse``: the weighted reuse distance distribution, the share of accesses farther than the memory, and
  the Spearman correlation between the previous answer's length and the distance lower bound in hourly
  windows (B4).

Memory sizes are GiB (2^30 bytes), the unit of the trace authors' scripts (800 KiB per OPT-13B token).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvstream.commands._common import (console, nonnegative_float, nonnegative_int, positive_float, positive_int,
                                       require)
from kvstream.models import get_model, known_models

GIB = 1 << 30
PAPER = {
    "hp_vs_queue_aware": 0.576,  # B3: miss rate -57.6 % vs queue-enhanced (CachedAttention)
    "hp_vs_fifo_lru_lfu": 0.699,  # B3: -69.9 % vs FIFO / LRU / LFU
    "rho_min": 0.94,  # B4
    "rho_max": 0.98,
    "share_beyond_200gb": 0.80,  # 80 % of accesses farther than 200 GB
    "lru_hit_rate": 0.20,  # "LRU hits only about 20 %"
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    study = subparsers.add_parser("study", help="reproduce Bidaw's trace studies (eviction, reuse distance)")
    sub = study.add_subparsers(dest="study_command", metavar="STUDY")
    sub.required = True

    ev = sub.add_parser("eviction", help="cache-only replay: hit/miss rate of each eviction policy per memory size")
    _common(ev)
    ev.add_argument("--memory-gb", type=positive_float, nargs="+", default=[120.0, 160.0, 200.0], metavar="G",
                    help="host memory sizes in GiB (default: 120 160 200, the paper's range)")  # fmt: skip
    ev.add_argument("--policies", nargs="+", default=None, metavar="NAME",
                    help="policies to replay (default: fifo lru lfu inclusive queue-aware hit-potential belady)")  # fmt: skip
    ev.add_argument("--lookahead", type=positive_int, default=30, help="queue-aware look-ahead window in requests (default 30)")
    ev.add_argument("--keep-finished", action="store_true",
                    help="keep a conversation's KV after its last round (default: drop it, as the trace authors do)")  # fmt: skip
    ev.add_argument("--per-part", action="store_true", help="replay each trace part on its own, not only all together")
    ev.add_argument("--compact", action="store_true",
                    help="also replay hit-potential with compact tensors (MHA models: normalised input, half the bytes)")  # fmt: skip
    ev.set_defaults(handler=_run_eviction)

    ru = sub.add_parser("reuse", help="weighted reuse distance distribution and answer-length correlation")
    _common(ru)
    ru.add_argument("--memory-gb", type=positive_float, nargs="+", default=[120.0, 160.0, 200.0], metavar="G",
                    help="memory sizes in GiB for the 'share farther than memory' figure")  # fmt: skip
    ru.add_argument("--window-fraction", type=positive_float, default=0.3,
                    help="share of each hour's users kept in the uniform hourly windows (default 0.3, as the authors)")  # fmt: skip
    ru.add_argument("--window-offsets", type=nonnegative_float, nargs="+", default=[1200.0], metavar="S",
                    help="start of the 10-minute window, seconds into the cohort's hour (default 1200, as the authors)")  # fmt: skip
    ru.add_argument("--min-cohort", type=positive_int, default=300,
                    help="hourly windows only for hours in which at least this many users of a part start (default 300)")  # fmt: skip
    ru.set_defaults(handler=_run_reuse)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="a Bidaw trace file, or a folder of parts (*.txt)")
    p.add_argument("--model", type=_study_model, default="opt-13b", metavar="NAME",
                   help=f"model shape for KV bytes per token: {', '.join(known_models())} (default opt-13b)")
    p.add_argument("--user-fraction", type=positive_float, default=1.0,
                   help="keep this share of users (multiple of 0.1; the authors thin to 0.3). Default 1.0")  # fmt: skip
    p.add_argument("--context-cap", type=nonnegative_int, default=None,
                   help="cap a conversation's KV at this many tokens (default: the model's context; 0 = no cap)")  # fmt: skip
    p.add_argument("--limit", type=positive_int, default=None, help="read at most this many requests per trace file")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")


def _study_model(text: str) -> str:
    """``--model`` of the studies: a name from :mod:`kvstream.models` (case-insensitive)."""
    try:
        return get_model(text).name
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; choose from {', '.join(known_models())}") from None


def _model_and_cap(args: argparse.Namespace) -> tuple[Any, int | None]:
    try:
        model = get_model(args.model)
    except KeyError as exc:
        from kvstream.errors import UsageError

        raise UsageError(str(exc.args[0])) from None
    cap = model.max_positions if args.context_cap is None else (args.context_cap or None)
    frac = args.user_fraction
    if not 0 < frac <= 1 or abs(round(10 * frac) - 10 * frac) > 1e-9:
        from kvstream.errors import UsageError

        raise UsageError(f"--user-fraction must be a multiple of 0.1 in (0, 1], got {frac}")
    return model, cap


@contextmanager
def _progress(enabled: bool, total: int, label: str) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda _n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True, console=_console(stderr=True)) as prog:  # fmt: skip
        task = prog.add_task(label, total=total)
        yield lambda n: prog.update(task, completed=n)


def _console(stderr: bool = False) -> Any:
    # Piped output would cut the wide tables at 80 columns; the shared console gives it room.
    return console(stderr=stderr)


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f}%"


# ---------------------------------------------------------------------------------------------------------------
# eviction


def _run_eviction(args: argparse.Namespace) -> int:
    from kvstream.compact import PAPER_KFLOP_PER_BYTE, choose_cached_tensor
    from kvstream.errors import UsageError
    from kvstream.eviction import eviction_policy_names
    from kvstream.study.cache_replay import STUDY_POLICIES, build_accesses, replay
    from kvstream.workload.bidaw import read_bidaw_trace

    model, cap = _model_and_cap(args)
    policies = list(args.policies or STUDY_POLICIES)
    unknown = [p for p in policies if p not in eviction_policy_names()]
    if unknown:
        raise UsageError(f"unknown eviction policies {unknown}; known: {', '.join(eviction_policy_names())}")
    if any(g <= 0 for g in args.memory_gb):
        raise UsageError("--memory-gb values must be positive")
    trace = read_bidaw_trace(args.trace, limit=args.limit).sample_users(args.user_fraction)
    choice = choose_cached_tensor(model)
    scopes: list[tuple[str, Any]] = [("all parts", trace)]
    if args.per_part and len(trace.sources) > 1:
        scopes += [(_short(src), trace.select(trace.part == i)) for i, src in enumerate(trace.sources)]
    runs: list[tuple[str, str, float, int]] = []  # scope, policy label, GiB, bytes per token
    for scope, _t in scopes:
        for g in args.memory_gb:
            runs += [(scope, p, g, choice.kv.bytes_per_token) for p in policies]
            if args.compact and choice.tensor != "kv":
                runs.append((scope, "hit-potential+compact", g, choice.bytes_per_token))
    total = sum(len(t) for s, t in scopes for r in runs if r[0] == s)
    rows: list[dict[str, Any]] = []
    done = 0
    with _progress(not args.json and sys.stderr.isatty(), total, "replaying") as tick:
        streams: dict[tuple[str, int], Any] = {}
        for scope, label, g, bpt in runs:
            t = dict(scopes)[scope]
            stream = streams.get((scope, bpt))
            if stream is None:
                stream = streams[(scope, bpt)] = build_accesses(t, bytes_per_token=bpt, context_cap=cap)
            policy = label.split("+")[0]
            base = done

            def advance(k: int, base: int = base) -> None:
                tick(base + k)

            res = replay(stream, policy, int(g * GIB), lookahead=args.lookahead, drop_finished=not args.keep_finished,
                         progress=advance)  # fmt: skip
            done += len(stream)
            rows.append({"scope": scope, "memory_gib": g, "policy": label, "hits": res.hits, "misses": res.misses,
                         "hit_rate": res.hit_rate, "miss_rate": res.miss_rate, "evictions": res.evictions})  # fmt: skip
    summary = _b3(rows)
    compact = {
        "model": model.name, "attention": model.attention, "cached_tensor": choice.tensor,
        "space_ratio": choice.space_ratio, "kv_kflop_per_byte": choice.kv.kflops_per_byte,
        "normed_input_kflop_per_byte": choice.normed_input.kflops_per_byte, "paper_kflop_per_byte": PAPER_KFLOP_PER_BYTE,
    }  # fmt: skip
    info = {
        "files": list(trace.sources), "requests": len(trace), "users": trace.n_users, "user_fraction": args.user_fraction,
        "model": model.name, "kv_bytes_per_token": choice.kv.bytes_per_token, "context_cap": cap,
        "drop_finished": not args.keep_finished, "lookahead": args.lookahead, "memory_unit": "GiB",
    }  # fmt: skip
    if args.json:
        print(json.dumps({"trace": info, "results": rows, "b3": summary, "compact": compact, "paper": PAPER}, indent=2))
        return 0
    _print_eviction(info, rows, summary, compact)
    return 0


def _short(path: str) -> str:
    """``total_traces_part3.txt`` -> ``part3``; other names unchanged (without folders)."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    m = re.search(r"(part\d+)", name)
    return m.group(1) if m else name


def _b3(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bidaw's B3 figures per (scope, memory): relative miss-rate reductions of hit potential."""
    by: dict[tuple[str, float], dict[str, float]] = {}
    for r in rows:
        by.setdefault((r["scope"], r["memory_gib"]), {})[r["policy"]] = r["miss_rate"]
    out = []
    for (scope, g), m in by.items():
        hp = m.get("hit-potential")
        if hp is None:
            continue
        generic = [m[p] for p in ("fifo", "lru", "lfu") if p in m]
        mean_generic = float(np.mean(generic)) if generic else float("nan")
        qa = m.get("queue-aware", float("nan"))
        bel = m.get("belady", float("nan"))
        hpc = m.get("hit-potential+compact", float("nan"))
        out.append({
            "scope": scope, "memory_gib": g,
            "hp_vs_queue_aware": 1 - hp / qa if qa else float("nan"),
            "hp_vs_fifo_lru_lfu": 1 - hp / mean_generic if mean_generic else float("nan"),
            "belady_vs_queue_aware": 1 - bel / qa if qa else float("nan"),
            "belady_vs_fifo_lru_lfu": 1 - bel / mean_generic if mean_generic else float("nan"),
            "hp_compact_vs_queue_aware": 1 - hpc / qa if qa else float("nan"),
            "hp_compact_vs_fifo_lru_lfu": 1 - hpc / mean_generic if mean_generic else float("nan"),
            "lru_hit_rate": 1 - m["lru"] if "lru" in m else float("nan"),
        })  # fmt: skip
    return out


def _print_eviction(info: dict[str, Any], rows: list[dict[str, Any]], summary: list[dict[str, Any]], compact: dict[str, Any]) -> None:
    from rich.table import Table

    con = _console()
    con.print(f"[bold]Cache-only replay[/] of {info['requests']:,} requests from {info['users']:,} users "
              f"({len(info['files'])} file(s), user fraction {info['user_fraction']}), {info['model']}: "
              f"{info['kv_bytes_per_token']:,} B/token, KV capped at {info['context_cap']} tokens, "
              f"finished conversations {'dropped' if info['drop_finished'] else 'kept'}.")  # fmt: skip
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for scope in dict.fromkeys(r["scope"] for r in rows):
        t = Table(title=f"Miss rate ({scope}; hit rate = 1 - miss rate)")
        t.add_column("memory (GiB)", justify="right")
        for p in policies:
            t.add_column(p, justify="right")
        for g in dict.fromkeys(r["memory_gib"] for r in rows if r["scope"] == scope):
            m = {r["policy"]: r["miss_rate"] for r in rows if r["scope"] == scope and r["memory_gib"] == g}
            t.add_row(f"{g:g}", *[_pct(m.get(p, float("nan"))) for p in policies])
        con.print(t)
    if summary:
        t = Table(title="B3: miss-rate reduction of hit potential (paper: -57.6 % vs queue-enhanced, -69.9 % vs FIFO/LRU/LFU)")
        compact_cols = any(s["hp_compact_vs_queue_aware"] == s["hp_compact_vs_queue_aware"] for s in summary)
        cols = ["scope", "memory (GiB)", "vs queue-aware", "vs mean(FIFO,LRU,LFU)", "Belady bound vs QA",
                "Belady bound vs generic"]  # fmt: skip
        if compact_cols:
            cols += ["+compact vs QA", "+compact vs generic"]
        for c in (*cols, "LRU hit rate (paper ~20%)"):
            t.add_column(c, justify="right")
        for s in summary:
            cells = [s["scope"], f"{s['memory_gib']:g}", _pct(-s["hp_vs_queue_aware"]), _pct(-s["hp_vs_fifo_lru_lfu"]),
                     _pct(-s["belady_vs_queue_aware"]), _pct(-s["belady_vs_fifo_lru_lfu"])]  # fmt: skip
            if compact_cols:
                cells += [_pct(-s["hp_compact_vs_queue_aware"]), _pct(-s["hp_compact_vs_fifo_lru_lfu"])]
            t.add_row(*cells, _pct(s["lru_hit_rate"]))
        con.print(t)
    p = compact["paper_kflop_per_byte"]
    con.print(f"B8 compact tensors, {compact['model']} ({compact['attention']}): caches {compact['cached_tensor']}, "
              f"{compact['space_ratio']:.2f}x less space than K,V; saved kFLOP/byte: normalised input "
              f"{compact['normed_input_kflop_per_byte']:.1f} vs K,V {compact['kv_kflop_per_byte']:.1f} "
              f"(paper {p['normed_input']} vs {p['kv']}).")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# reuse


def _run_reuse(args: argparse.Namespace) -> int:
    from kvstream.compact import choose_cached_tensor
    from kvstream.errors import UsageError
    from kvstream.study.reuse import answer_distance_correlation, authors_windows, hourly_windows, weighted_reuse_distances
    from kvstream.workload.bidaw import read_bidaw_trace

    require("scipy", "study reuse (Spearman correlation)")
    model, cap = _model_and_cap(args)
    if not 0 < args.window_fraction <= 1:
        raise UsageError("--window-fraction must be in (0, 1]")
    full = read_bidaw_trace(args.trace, limit=args.limit)
    bpt = choose_cached_tensor(model).kv.bytes_per_token
    # Distribution: per part (users of a part only, as the authors measure) and over the parts' union.
    dist_rows = []
    scopes = [(_short(s), full.select(full.part == i)) for i, s in enumerate(full.sources)]
    if len(scopes) > 1:
        scopes.append(("all parts", full))
    for name, part in scopes:
        t = part.sample_users(args.user_fraction)
        hist = t.history_tokens if cap is None else np.minimum(t.history_tokens, cap)
        d = weighted_reuse_distances(t.user, hist * bpt)
        d = d[~np.isnan(d)] / GIB
        row: dict[str, Any] = {"scope": name, "reuses": int(d.size)}
        if d.size:
            row.update({f"p{q}": float(np.percentile(d, q)) for q in (10, 25, 50, 75, 90)})
            row["share_beyond"] = {f"{g:g}": float(np.mean(d > g)) for g in args.memory_gb}
        dist_rows.append(row)
    # Correlation windows: the authors' own (where their part is here) and the same recipe on every hour.
    have, missing = authors_windows(full)
    windows = [("authors", s) for s in have]
    for off in args.window_offsets:
        hourly = hourly_windows(full, fraction=args.window_fraction, offset=off, min_cohort=args.min_cohort)
        windows += [("hourly", s) for s in hourly]
    corr_rows: list[dict[str, Any]] = []
    for kind, spec in windows:
        r = answer_distance_correlation(full, spec, bytes_per_token=bpt, context_cap=cap)
        corr_rows.append({"kind": kind, "label": spec.label, "source": _short(spec.source), "fraction": spec.fraction,
                          "window_start_s": spec.window_start, "samples": r.samples, "points": r.points,
                          "rho": r.rho, "pvalue": r.pvalue, "sample_rho": r.sample_rho})  # fmt: skip
    summary: dict[str, Any] = {"authors_windows_missing": missing, "min_points": 10}
    for kind in ("authors", "hourly"):
        rhos = [c["rho"] for c in corr_rows if c["kind"] == kind and c["points"] >= 10 and c["rho"] == c["rho"]]
        summary[kind] = {"windows": len(rhos), "rho_min": min(rhos) if rhos else None,
                         "rho_median": float(np.median(rhos)) if rhos else None, "rho_max": max(rhos) if rhos else None}  # fmt: skip
    info = {"files": list(full.sources), "requests": len(full), "users": full.n_users, "model": model.name,
            "kv_bytes_per_token": bpt, "context_cap": cap, "user_fraction": args.user_fraction, "memory_unit": "GiB"}  # fmt: skip
    if args.json:
        print(json.dumps({"trace": info, "distribution": dist_rows, "correlation": corr_rows, "b4": summary,
                          "paper": PAPER}, indent=2))  # fmt: skip
        return 0
    _print_reuse(info, dist_rows, corr_rows, summary, args.memory_gb)
    return 0


def _print_reuse(info: dict[str, Any], dist_rows: list[dict[str, Any]], corr_rows: list[dict[str, Any]],
                 summary: dict[str, Any], memory: list[float]) -> None:  # fmt: skip
    from rich.table import Table

    con = _console()
    con.print(f"[bold]Weighted reuse distance[/] ({info['model']}, {info['kv_bytes_per_token']:,} B/token, KV capped at "
              f"{info['context_cap']} tokens, user fraction {info['user_fraction']}); GiB.")  # fmt: skip
    t = Table(title="Distribution of weighted reuse distance (paper: 80 % of accesses beyond 200 GB)")
    for col in ("scope", "reuses", "p10", "p25", "p50", "p75", "p90", *[f"> {g:g}" for g in memory]):
        t.add_column(col, justify="right")
    for r in dist_rows:
        if "p50" not in r:
            t.add_row(r["scope"], str(r["reuses"]), *["-"] * (5 + len(memory)))
            continue
        t.add_row(r["scope"], f"{r['reuses']:,}", *[f"{r[f'p{q}']:.0f}" for q in (10, 25, 50, 75, 90)],
                  *[_pct(r["share_beyond"][f"{g:g}"]) for g in memory])  # fmt: skip
    con.print(t)
    t = Table(title="B4: Spearman rho, previous answer length vs reuse-distance lower bound (paper: 0.94-0.98, 12 windows)")
    for col in ("windows", "hour", "part", "users kept", "window at (s)", "samples", "points", "rho", "rho over samples"):
        t.add_column(col, justify="right")
    for c in corr_rows:
        rho = "n/a" if c["rho"] != c["rho"] else f"{c['rho']:.3f}"
        srho = "n/a" if c["sample_rho"] != c["sample_rho"] else f"{c['sample_rho']:.3f}"
        at = f"+{c['window_start_s'] % 3600:.0f}"
        t.add_row(c["kind"], c["label"], c["source"], f"{c['fraction']:g}", at, f"{c['samples']:,}", str(c["points"]), rho, srho)
    con.print(t)
    for kind in ("authors", "hourly"):
        k = summary[kind]
        if k["windows"]:
            con.print(f"B4, {kind} windows ({k['windows']} with >= 10 points): rho {k['rho_min']:.3f} - {k['rho_max']:.3f} "
                      f"(median {k['rho_median']:.3f}); paper 0.94 - 0.98 over 12 windows.")  # fmt: skip
    if summary["authors_windows_missing"]:
        con.print("Authors' windows whose trace part is not here: " + ", ".join(summary["authors_windows_missing"]))
