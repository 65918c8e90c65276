"""``kvstream report``: gather simulate and replay results from one folder into one HTML page.

    kvstream simulate --scenario all --out sim-out
    kvstream report --in sim-out --out sim-out/report.html
    kvstream replay --out kvstream-out && kvstream report --in kvstream-out

The page has one section per scenario (NAME.json written by ``kvstream simulate``): its set-up, the table of
paper figure vs this project's figure with a verdict, and its PNG embedded; and one per replay (``replay.json``
written by ``kvstream replay``): its set-up, TTFT and bytes read per tier for each system, and ``replay.png``
(TTFT CDFs, bytes per tier over time). The page is a single self-contained file.

Each section says how its result was made, from what the command recorded in its JSON: the kvstream version,
the command line and whether ``--quick`` was used (a shrunk run whose verdicts may differ); the top of the page
says how many results were quick runs and which versions wrote them, and which kvstream wrote the page.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import shlex
import sys
from pathlib import Path
from typing import Any

__all__ = ["register", "build_report"]

_VERDICT_COLOUR = {"reproduced": "#d7f5d7", "beats": "#b9ecff", "close": "#fff3c4", "not reproduced": "#ffd9d9",
                   "info": "#eeeeee"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("report", help="gather simulate/replay results into one HTML page",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--in", dest="inp", default="sim-out", metavar="DIR",
                   help="folder with results: NAME.json and NAME.png of kvstream simulate --out DIR, or "
                        "replay.json and replay.png of kvstream replay --out DIR (default sim-out)")
    p.add_argument("--out", default=None, help="HTML file to write (default IN/report.html)")
    p.set_defaults(handler=_run)


def _img(path: Path) -> str:
    if not path.exists():
        return f"<p><i>missing figure {html.escape(path.name)}</i></p>"
    b64 = base64.b64encode(path.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{b64}" style="max-width:100%">'


def _section(res: dict[str, Any], folder: Path) -> str:
    rows = []
    for r in res.get("rows", []):
        colour = _VERDICT_COLOUR.get(r.get("verdict", ""), "#ffffff")
        note = f"<br><small>{html.escape(r['note'])}</small>" if r.get("note") else ""
        rows.append(
            f"<tr><td>{html.escape(r['target'])}</td><td>{html.escape(r['claim'])}{note}</td>"
            f"<td>{html.escape(r['paper'])}</td><td>{html.escape(r['ours'])}</td>"
            f"<td style='background:{colour}'>{html.escape(r['verdict'])}</td></tr>"
        )
    figs = "".join(_img(folder / f) for f in res.get("figures", []))
    return (
        f"<h2 id='{html.escape(res['name'])}'>{html.escape(res['name'])}: {html.escape(res.get('title', ''))}</h2>"
        f"<p>{html.escape(res.get('setup', ''))} <small>(wall {res.get('wall_s', 0):.1f} s)</small></p>"
        + _run_line(res) +
        "<table><tr><th>row</th><th>claim</th><th>paper</th><th>this project</th><th>verdict</th></tr>"
        + "".join(rows) + "</table>" + figs
    )


def _command(argv: Any) -> str:
    """A recorded ``sys.argv`` as a shell line, the program shown as ``kvstream`` rather than its full path."""
    if isinstance(argv, str):
        return argv
    if not isinstance(argv, list) or not argv:
        return "?"
    prog = Path(str(argv[0])).name
    if prog in ("__main__.py", "cli.py", ""):  # python -m kvstream
        prog = "kvstream"
    return shlex.join([prog, *map(str, argv[1:])])


def _run_line(res: dict[str, Any]) -> str:
    """How a result was made: version, command line and ``--quick``, as recorded in its JSON."""
    if "version" not in res and "command_line" not in res:
        return ("<p class='run'><small>run: version and command line not recorded in this result (an older "
                "kvstream wrote it)</small></p>")
    parts = [f"kvstream {html.escape(str(res.get('version', '?')))}",
             f"<code>{html.escape(_command(res.get('command_line')))}</code>"]
    if "quick" in res:
        parts.append("<span style='background:#fff3c4'><b>--quick</b>: a shrunk run; its verdicts may differ from a "
                     "full run's</span>" if res["quick"] else "full run (no --quick)")
    return "<p class='run'><small>run: " + " · ".join(parts) + "</small></p>"


def _f(x: Any, fmt: str = ".3f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def _replay_section(res: dict[str, Any], folder: Path, anchor: str) -> str:
    """One replay (``replay.json``): set-up, a row per system, and ``replay.png``."""
    tiers = sorted({k.removeprefix("storage_read_bytes_") for r in res["results"] for k in r.get("summary", {})
                    if k.startswith("storage_read_bytes_")})
    head = ["system", "TTFT mean s", "P50", "P90", "P99", "SLO", "read/step s", *[f"{t} GB read" for t in tiers],
            "write amp", "wall s"]
    rows = []
    for r in res["results"]:
        s = r.get("summary", {})
        slo = s.get("slo_attainment")
        cells = [r.get("system", "?"), _f(s.get("ttft_mean_s")), _f(s.get("ttft_p50_s")), _f(s.get("ttft_p90_s")),
                 _f(s.get("ttft_p99_s")), f"{100 * slo:.0f} %" if isinstance(slo, (int, float)) else "-",
                 _f(s.get("read_time_per_step_s"), ".4f"),
                 *[_f(s.get(f"storage_read_bytes_{t}", 0) / 1e9, ".2f") for t in tiers],
                 _f(s.get("storage_write_amplification"), ".2f"), _f(r.get("wall_s"), ".0f")]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    setup = (f"{res.get('workload', '')}; {res.get('model', '')} on {res.get('gpu', '')} (modelled); shared tier "
             f"{res.get('shared_tier', '?')}; GPU KV {res.get('gpu_kv', '?')}, host memory {res.get('memory', '?')}, "
             f"arrivals x{res.get('speed', '?')}")
    notes = "".join(f"<p><small>note: {html.escape(str(n))}</small></p>" for n in res.get("notes", []))
    return (
        f"<h2 id='{html.escape(anchor)}'>{html.escape(anchor)}: real store, modelled GPU</h2>"
        f"<p>{html.escape(setup)}</p>{_run_line(res)}{notes}"
        "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"
        + (_img(folder / "replay.png") if res.get("figure", "") is not None
           else "<p><i>no figure: matplotlib was not installed for this replay</i></p>")
    )


def _is_scenario(data: Any) -> bool:
    return isinstance(data, dict) and "rows" in data and "name" in data


def _is_replay(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("results"), list) and "workload" in data


def find_results(folder: Path) -> list[tuple[str, Path, dict[str, Any]]]:
    """(kind, file, data) of every result in ``folder``: ``scenario`` (NAME.json of simulate) or ``replay``
    (replay.json of replay, also one level down, e.g. several replays' --out folders under one)."""
    found: list[tuple[str, Path, dict[str, Any]]] = []
    for p in sorted([*folder.glob("*.json"), *folder.glob("*/replay.json")]):
        try:
            data = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if _is_scenario(data):
            found.append(("scenario", p, data))
        elif _is_replay(data):
            found.append(("replay", p, data))
    return found


def _summary(results: list[dict[str, Any]]) -> str:
    """The page's first lines: which kvstream wrote it, which versions wrote the results, how many were quick."""
    from kvstream import __version__

    lines = [f"this page: kvstream {html.escape(__version__)}, <code>{html.escape(_command(sys.argv))}</code>"]
    versions = sorted({str(r["version"]) for r in results if "version" in r})
    if versions:
        lines.append("results written by kvstream " + ", ".join(html.escape(v) for v in versions))
    quick = sum(1 for r in results if r.get("quick"))
    if quick:
        lines.append(f"<span style='background:#fff3c4'><b>{quick} of {len(results)} results ran with --quick</b> "
                     "(a shrunk workload: their verdicts may differ from a full run's)</span>")
    return "<p><small>" + "<br>".join(lines) + "</small></p>"


def build_report(folder: Path) -> str:
    sections = []
    anchors = []
    results = find_results(folder)
    for kind, path, data in results:
        if kind == "scenario":
            anchors.append(data["name"])
            sections.append(_section(data, path.parent))
        else:
            anchor = "replay" if path.parent == folder else f"replay {path.parent.name}"
            anchors.append(anchor)
            sections.append(_replay_section(data, path.parent, anchor))
    toc = " · ".join(f"<a href='#{html.escape(a)}'>{html.escape(a)}</a>" for a in anchors)
    body = "".join(sections) or "<p>No results found.</p>"
    return (
        "<!doctype html><meta charset='utf-8'><title>kvstream: results</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:90%}</style>"
        "<h1>kvstream results: the papers' figures beside this project's, and replays</h1>"
        f"{_summary([d for _, _, d in results])}<p>{toc}</p>{body}"
    )


def _run(args: argparse.Namespace) -> int:
    folder = Path(args.inp)
    if not folder.is_dir():
        from kvstream.errors import UsageError

        raise UsageError(f"no results folder {folder} (run `kvstream simulate --scenario all --out {folder}` or "
                         f"`kvstream replay --out {folder}` first)")
    if not find_results(folder):
        from kvstream.errors import UsageError

        raise UsageError(f"no results in {folder}: expected NAME.json files written by `kvstream simulate --scenario "
                         f"NAME --out {folder}`, or replay.json written by `kvstream replay --out {folder}`")
    out = Path(args.out) if args.out else folder / "report.html"
    out.write_text(build_report(folder))
    print(f"wrote {out}")
    return 0
