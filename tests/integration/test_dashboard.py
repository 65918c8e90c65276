"""The Grafana dashboard (deploy/grafana/kvstream.json) and the alert rules (deploy/prometheus/kvstream-alerts.yml)
query only metrics that kvstream's LMCache plugin really exports.

"Really exports" is read off a live registry: real traffic through LMCache 0.5.6's StorageManager with the plugin,
then every metric family in prometheus_client's default registry, with the sample names its type gives it in the
text exposition (a counter ``x`` is scraped as ``x_total``, a histogram as ``x_bucket``/``x_count``/``x_sum``).
A query naming ``lmcache:kvstream_num_hit_chunks`` (no ``_total``) or a renamed metric fails here, not on an
operator's empty panel.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

for _k, _v in {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}.items():
    os.environ[_k] = _v  # LMCache (imported inside the live test) reports usage over the network by default

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvstream.json"
ALERTS = REPO / "deploy" / "prometheus" / "kvstream-alerts.yml"
PREFIX = "lmcache:kvstream_"

# PromQL words that look like metric names: binary/set operators, modifiers, and the literals.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
             "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![A-Za-z0-9_:.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (what a scrape must have for it to return data).

    Strings (label values, Grafana's ``$variables`` inside them), label matchers ``{...}``, ranges ``[...]`` and
    grouping label lists go first; what is left is functions (a name followed by ``(``), keywords, numbers and
    metric names."""
    text = re.sub(r"\$\{?\w+\}?", " ", _STRING.sub(" ", expr))
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    return {m.group(1) for m in _IDENT.finditer(text) if not m.group(2) and m.group(1) not in _KEYWORDS}


def _label_values_metric(query: str) -> set[str]:
    """The metric of a Grafana ``label_values(METRIC{...}, label)`` variable query (none for ``label_values(label)``)."""
    m = re.fullmatch(r"\s*label_values\(\s*(.*),\s*\w+\s*\)\s*", query)
    return metric_names(m.group(1)) if m else metric_names(query)


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])  # panels of a collapsed row


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every variable query of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in _panels(dash) for t in p.get("targets", [])]
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']!r}", q))
    return out


def alert_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(f"alert {r['alert']!r}", r["expr"]) for g in rules["groups"] for r in g["rules"]]


def _names(where: str, query: str) -> set[str]:
    return _label_values_metric(query) if where.startswith("variable") else metric_names(query)


# -- the checker itself --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (tier) (rate(lmcache:kvstream_num_hit_chunks_total{model_name=~"$model_name"}[$__rate_interval]))',
     {"lmcache:kvstream_num_hit_chunks_total"}),
    ("histogram_quantile(0.99, sum by (tier, le) (rate(x_bucket{a=\"b,c}\"}[5m])))", {"x_bucket"}),
    ("max by (tier) (a) / on (tier) group_left max by (tier) (b) > bool 0.5", {"a", "b"}),
    ("sum(rate(a_total[5m] offset 1h)) unless absent(up) or vector(1e3)", {"a_total", "up"}),
    ("rate(a_total[5m:30s]) * 100 and b", {"a_total", "b"}),
    ('label_values(lmcache:kvstream_capacity_bytes{model_name=~"$model_name"}, worker_id)',
     {"lmcache:kvstream_capacity_bytes"}),
])
def test_metric_names_of_a_query(expr: str, names: set[str]) -> None:
    assert (_label_values_metric(expr) if expr.startswith("label_values") else metric_names(expr)) == names


def test_dashboard_and_alerts_are_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    panels = list(_panels(dash))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model_name", "worker_id"} <= variables
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 15
    for p in graphs:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), (p["title"], t["expr"])
            assert metric_names(t["expr"]), f"panel {p['title']!r}: a query that names no metric: {t['expr']}"
            for m in metric_names(t["expr"]):  # every query is narrowed to the chosen model and workers
                assert f'{m}{{model_name=~"$model_name", worker_id=~"$worker_id"}}' in t["expr"], (p["title"], m)
    alerts = alert_queries()
    assert len(alerts) >= 5 and all(names for names in (metric_names(q) for _, q in alerts))


# -- against a live registry ---------------------------------------------------------------------------------------
def _exported_sample_names(registry: Any = None) -> tuple[set[str], set[str]]:
    """(every sample name the registry's families can be scraped as, those with a sample now); default: the
    default registry."""
    from prometheus_client import REGISTRY

    registry = REGISTRY if registry is None else registry
    suffixes = {"counter": ["_total", "_created"], "gauge": [""], "histogram": ["_bucket", "_count", "_sum", "_created"],
                "summary": ["", "_count", "_sum", "_created"], "info": ["_info"], "stateset": [""], "unknown": [""],
                "gaugehistogram": ["_bucket", "_gcount", "_gsum"]}
    names: set[str] = set()
    with_samples: set[str] = set()
    for fam in registry.collect():
        names.update(fam.name + s for s in suffixes[fam.type])
        with_samples.update(s.name for s in fam.samples)
    return names, with_samples


@pytest.fixture(scope="module")
def live_registry() -> Iterator[None]:
    """Real traffic through LMCache 0.5.6's StorageManager with the plugin (puts, reads, close): afterwards the
    default registry holds every family the plugin and LMCache export."""
    import shutil
    import tempfile

    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.pin_monitor import PinMonitor
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    from lmcache.v1.token_database import ChunkedTokenDatabase

    disk_tmp = Path(tempfile.mkdtemp(prefix="kvstream-test-dash-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
    chunk = 256
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk, local_cpu=False, max_local_cpu_size=0.06, storage_plugins=["kvstream"],
        extra_config={"storage_plugin.kvstream.module_path": "kvstream.integrations.lmcache",
                      "storage_plugin.kvstream.class_name": "KVStreamBackend",
                      "kvstream.tiers": f"local={disk_tmp / 'local'},shared={disk_tmp / 'shared'}",
                      "kvstream.capacity_bytes": "64MiB", "kvstream.memory_bytes": "8MiB"})
    meta = LMCacheMetadata(model_name="test/dashboard", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, chunk, 2, 64), role="worker")
    PinMonitor.GetOrCreate(cfg)
    sm = StorageManager(cfg, meta, EventManager())
    try:
        keys = [k for _, _, k in ChunkedTokenDatabase(cfg, meta).process_tokens(tokens=list(range(3 * chunk)))]
        objs = []
        for _ in keys:
            obj = sm.allocate(torch.Size((2, 2, chunk, 128)), torch.bfloat16, MemoryFormat.KV_2LTD)
            assert obj is not None
            obj.tensor.fill_(1)
            objs.append(obj)
        sm.batched_put(keys, objs)
        plugin = sm.storage_backends["kvstream"]
        deadline = time.monotonic() + 10
        while any(plugin.exists_in_put_tasks(k) for k in keys):
            assert time.monotonic() < deadline, "puts not stored in time"
            time.sleep(0.01)
        got = sm.batched_get(keys, location="kvstream")
        assert all(o is not None for o in got)
        for o in got:
            o.ref_count_down()
    finally:
        sm.close()  # publishes the store's figures (capacity, usage, evictions) one last time
        shutil.rmtree(disk_tmp, ignore_errors=True)
    yield


@pytest.mark.lmcache
@pytest.mark.timeout(120)
def test_every_query_names_a_metric_the_plugin_exports(live_registry: None) -> None:
    exported, with_samples = _exported_sample_names()
    assert {PREFIX + "capacity_bytes", PREFIX + "num_hit_chunks_total", PREFIX + "time_to_chunk_bucket"} <= with_samples

    queries = dashboard_queries() + alert_queries()
    for where, query in queries:
        for name in _names(where, query):
            # the dashboard shows kvstream's metrics; an alert may also name LMCache's own (who runs LMCache)
            ours = name.startswith(PREFIX) or (where.startswith("alert") and name.startswith("lmcache:"))
            assert ours, f"{where} names {name}, which is not one of kvstream's metrics"
            assert name in exported, (f"{where} names {name}, which neither kvstream nor LMCache exports; exported: "
                                      f"{sorted(n for n in exported if n.startswith('lmcache:'))}")
    # and the dashboard shows what operators asked for: capacity, usage, evictions, hits, misses, latencies
    dash_names = {n for where, q in dashboard_queries() for n in _names(where, q)}
    for wanted in ("capacity_bytes", "used_bytes", "chunks", "num_evicted_chunks_total", "num_hit_chunks_total",
                   "num_miss_chunks_total", "time_to_chunk_bucket", "time_to_get_bucket", "time_to_put_bucket",
                   "num_written_bytes_total", "tier_circuit_open", "time_to_write_bucket"):
        assert PREFIX + wanted in dash_names, f"no dashboard panel shows {PREFIX + wanted}"


def _documented_names(registry: Any = None) -> set[str]:
    """The names a doc may give a metric: what a scrape shows (a counter with ``_total``, a gauge as is) and the
    family name of a histogram (whose samples are ``_bucket``/``_count``/``_sum``)."""
    from prometheus_client import REGISTRY

    names, _ = _exported_sample_names(registry)
    names = {n for n in names if not n.endswith("_created")}
    return names | {fam.name for fam in (REGISTRY if registry is None else registry).collect()
                    if fam.type in ("histogram", "summary")}


_DOC_METRIC = re.compile(r"(?<![\w:.])((?:lmcache:)?kvstream_[a-z0-9_]+)|\.\.\._([a-z0-9_]+)")


@pytest.mark.lmcache
@pytest.mark.timeout(120)
def test_the_docs_name_metrics_as_they_are_scraped(live_registry: None, disk_tmp: Path) -> None:
    """Every ``kvstream_*`` and ``lmcache:kvstream_*`` name in README.md and docs/*.md is one a scrape shows: a
    counter with its ``_total`` (docs/operators.md named two without it), a gauge, or a histogram's family name.
    ``..._suffix`` abbreviates the name before it on the same line. The plugin's names come from the live
    registry, the library collector's (``kvstream.metrics``) from a real store."""
    from prometheus_client import CollectorRegistry

    import kvstream
    from kvstream.metrics import StoreCollector

    plugin = {n for n in _documented_names() if n.startswith(PREFIX)}
    registry = CollectorRegistry()
    with kvstream.open_store({"tiers": [{"name": "local", "path": str(disk_tmp / "t"), "capacity_bytes": "64MiB"}],
                              "memory_bytes": "8MiB", "create_dirs": True}) as store:
        registry.register(StoreCollector(store))
        library = _documented_names(registry)
    known = plugin | library
    assert "kvstream_tier_read_busy_seconds_total" in library and PREFIX + "num_hit_chunks_total" in plugin
    checked = 0
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            last: str | None = None
            for m in _DOC_METRIC.finditer(line):
                where = f"{doc.relative_to(REPO)}:{n}"
                if m.group(1):
                    last = m.group(1)
                    assert last in known, f"{where} names {last}, which is not scraped as such" + (
                        f" (the counter is {last}_total)" if f"{last}_total" in known else "")
                elif last is not None:  # ..._suffix: the name before it, its last words replaced
                    cuts = [last[: i + 1] for i, c in enumerate(last) if c == "_"]
                    assert any(cut + m.group(2) in known for cut in cuts), f"{where}: ..._{m.group(2)} after {last}"
                else:
                    continue
                checked += 1
    assert checked >= 40


# -- the "plugin not loaded" alert is per server and worker --------------------------------------------------------
_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>=~|!~|!=|==|[(){},=])|(?P<word>[A-Za-z_:][A-Za-z0-9_:]*)'
                    r'|(?P<num>[0-9.]+))')


class _PromQL:
    """A tiny PromQL evaluator for the alert rules' forms (no promtool here): selectors with label matchers,
    ``max|min|sum|count [by (..)] (..)``, ``absent(..)`` and ``unless|and|or [on (..)]``, over an instant's series
    (label dicts with ``__name__``). Anything else raises, so a rule this cannot read fails loudly."""

    def __init__(self, expr: str) -> None:
        self.toks: list[tuple[str, str]] = []
        pos, expr = 0, expr.strip()
        while pos < len(expr):
            m = _TOKEN.match(expr, pos)
            assert m and m.end() > pos, f"cannot read {expr[pos:]!r}"
            kind = m.lastgroup or ""
            self.toks.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def _peek(self) -> str | None:
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def _take(self, want: str | None = None) -> str:
        tok = self.toks[self.i][1]
        assert want is None or tok == want, (want, tok)
        self.i += 1
        return tok

    def _labels(self) -> list[str]:
        self._take("(")
        out = []
        while self._peek() != ")":
            out.append(self._take())
            if self._peek() == ",":
                self._take()
        self._take(")")
        return out

    def evaluate(self, series: list[dict[str, str]]) -> list[dict[str, str]]:
        out = self._expr(series)
        assert self.i == len(self.toks), f"unread: {self.toks[self.i:]}"
        return out

    def _expr(self, db: list[dict[str, str]]) -> list[dict[str, str]]:
        left = self._unary(db)
        while self._peek() in ("unless", "and", "or"):
            op = self._take()
            on = self._labels() if self._peek() == "on" and self._take() else None
            right = self._unary(db)

            def key(s: dict[str, str], on: list[str] | None = on) -> tuple[str, ...]:
                names = on if on is not None else sorted(k for k in s if k != "__name__")
                return tuple(s.get(n, "") for n in names)

            rkeys = {key(r) for r in right}
            if op == "unless":
                left = [s for s in left if key(s) not in rkeys]
            elif op == "and":
                left = [s for s in left if key(s) in rkeys]
            else:
                lkeys = {key(s) for s in left}
                left = left + [r for r in right if key(r) not in lkeys]
        return left

    def _unary(self, db: list[dict[str, str]]) -> list[dict[str, str]]:
        tok = self._take()
        if tok == "(":
            out = self._expr(db)
            self._take(")")
            return out
        if tok in ("max", "min", "sum", "count"):
            by = self._labels() if self._peek() == "by" and self._take() else []
            self._take("(")
            inner = self._expr(db)
            self._take(")")
            groups = {tuple(s.get(n, "") for n in by) for s in inner}
            return [dict(zip(by, g)) for g in sorted(groups)]
        if tok == "absent":
            self._take("(")
            inner = self._expr(db)
            self._take(")")
            return [] if inner else [{}]
        assert re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok) and self._peek() != "(", f"not supported: {tok}"
        matchers: list[tuple[str, str, str]] = []
        if self._peek() == "{":
            self._take("{")
            while self._peek() != "}":
                name, op, value = self._take(), self._take(), self._take()
                matchers.append((name, op, value[1:-1]))
                if self._peek() == ",":
                    self._take()
            self._take("}")

        def ok(s: dict[str, str]) -> bool:
            for name, op, value in matchers:
                v = s.get(name, "")
                if not {"=": v == value, "!=": v != value, "=~": bool(re.fullmatch(value, v)),
                        "!~": not re.fullmatch(value, v)}[op]:
                    return False
            return True

        return [s for s in db if s["__name__"] == tok and ok(s)]


def _alert(name: str) -> dict[str, Any]:
    rules = yaml.safe_load(ALERTS.read_text())
    return next(r for g in rules["groups"] for r in g["rules"] if r["alert"] == name)


def _server(instance: str, workers: dict[str, bool], *, job: str = "vllm", role: str = "worker") -> list[dict[str, str]]:
    """The series one vLLM server exports: LMCache's own per worker, and kvstream's where it loaded (worker ->
    loaded)."""
    out = []
    for worker, loaded in workers.items():
        base = {"job": job, "instance": instance, "model_name": "m", "worker_id": worker, "role": role,
                "served_model_name": ""}
        out.append({"__name__": "lmcache:lmcache_is_healthy", **base})
        if loaded:
            out += [{"__name__": PREFIX + "capacity_bytes", **base, "tier": t} for t in ("local", "memory")]
    return out


def test_plugin_not_loaded_alert_fires_per_server_and_worker() -> None:
    """The alert fires for each server and worker where LMCache runs without kvstream, whatever the other
    servers export (``absent()`` over all of them stayed silent while one server still had kvstream's series);
    not for a scheduler process, a server without LMCache, or a server where every worker loaded it."""
    rule = _alert("KVStreamPluginNotLoaded")
    assert "absent(" not in rule["expr"] and rule.get("for")
    series = (_server("a:8000", {"0": True, "1": True})
              + _server("a:8000", {"0": False}, role="scheduler")  # the scheduler process: no kvstream, by design
              + _server("b:8000", {"0": True, "1": False})  # worker 1's plugin failed (say, its tier folder)
              + _server("c:8000", {"0": False})  # kvstream never loaded on this server
              + [{"__name__": "up", "job": "node", "instance": "n:9100"}])  # not an LMCache server
    fired = _PromQL(rule["expr"]).evaluate(series)
    assert sorted((s["instance"], s["worker_id"]) for s in fired) == [("b:8000", "1"), ("c:8000", "0")]
    assert all({"job", "instance", "model_name", "worker_id"} <= set(s) for s in fired)  # the summary's labels
    for label in re.findall(r"\$labels\.(\w+)", rule["annotations"]["summary"]):
        assert all(label in s for s in fired), label
    healthy = _server("a:8000", {"0": True, "1": True}) + _server("b:8000", {"0": True})
    assert _PromQL(rule["expr"]).evaluate(healthy) == []
    # the evaluator reads the old rule's absent() too: silent here, the bug
    assert _PromQL("absent(lmcache:kvstream_capacity_bytes)").evaluate(series) == []
