"""``kvstream report``: gather every scenario's result (and a replay's, if present) into one HTML page.

    kvstream simulate --scenario all --out sim-out
    kvstream report --in sim-out --out sim-out/report.html

The page has one section per scenario: its set-up, the table of paper figure vs this project's figure with a
verdict, and its PNG embedded (the page is a single self-contained file).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
from pathlib import Path
from typing import Any

__all__ = ["register", "build_report"]

_VERDICT_COLOUR = {"reproduced": "#d7f5d7", "beats": "#b9ecff", "close": "#fff3c4", "not reproduced": "#ffd9d9",
                   "info": "#eeeeee"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="gather simulate/replay results into one HTML page")
    p.add_argument("--in", dest="inp", default="sim-out", help="folder with NAME.json and NAME.png (default sim-out)")
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
        "<table><tr><th>row</th><th>claim</th><th>paper</th><th>this project</th><th>verdict</th></tr>"
        + "".join(rows) + "</table>" + figs
    )


def build_report(folder: Path) -> str:
    results = []
    for p in sorted(folder.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "rows" in data and "name" in data:
            results.append(data)
    toc = " · ".join(f"<a href='#{html.escape(r['name'])}'>{html.escape(r['name'])}</a>" for r in results)
    body = "".join(_section(r, folder) for r in results) or "<p>No results found.</p>"
    return (
        "<!doctype html><meta charset='utf-8'><title>kvstream: paper figures vs this project</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:90%}</style>"
        "<h1>kvstream: the papers' figures beside this project's</h1>"
        f"<p>{toc}</p>{body}"
    )


def _run(args: argparse.Namespace) -> int:
    folder = Path(args.inp)
    if not folder.is_dir():
        raise FileNotFoundError(f"no results folder {folder} (run `kvstream simulate --scenario all --out {folder}`)")
    out = Path(args.out) if args.out else folder / "report.html"
    out.write_text(build_report(folder))
    print(f"wrote {out}")
    return 0
