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

REPO = Path(__file__).resolve().parents[1]
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
def _exported_sample_names() -> tuple[set[str], set[str]]:
    """(every sample name the default registry's families can be scraped as, those with a sample now)."""
    from prometheus_client import REGISTRY

    suffixes = {"counter": ["_total", "_created"], "gauge": [""], "histogram": ["_bucket", "_count", "_sum", "_created"],
                "summary": ["", "_count", "_sum", "_created"], "info": ["_info"], "stateset": [""], "unknown": [""],
                "gaugehistogram": ["_bucket", "_gcount", "_gsum"]}
    names: set[str] = set()
    with_samples: set[str] = set()
    for fam in REGISTRY.collect():
        names.update(fam.name + s for s in suffixes[fam.type])
        with_samples.update(s.name for s in fam.samples)
    return names, with_samples


@pytest.mark.lmcache
@pytest.mark.timeout(120)
def test_every_query_names_a_metric_the_plugin_exports(disk_tmp: Path) -> None:
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.pin_monitor import PinMonitor
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    from lmcache.v1.token_database import ChunkedTokenDatabase

    chunk = 256
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk, local_cpu=False, max_local_cpu_size=0.06, storage_plugins=["kvstream"],
        extra_config={"storage_plugin.kvstream.module_path": "kvstream.integrations.lmcache",
                      "storage_plugin.kvstream.class_name": "KVStreamBackend",
                      "kvstream.tiers": f"local={disk_tmp / 'local'},shared={disk_tmp / 'shared'}",
                      "kvstream.capacity_bytes": "64MiB", "kvstream.memory_bytes": "8MiB"})
    meta = LMCacheMetadata(model_name="test/dashboard", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, chunk, 2, 64))
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
    exported, with_samples = _exported_sample_names()
    assert {PREFIX + "capacity_bytes", PREFIX + "num_hit_chunks_total", PREFIX + "time_to_chunk_bucket"} <= with_samples

    queries = dashboard_queries() + alert_queries()
    for where, query in queries:
        for name in _names(where, query):
            assert name.startswith(PREFIX), f"{where} names {name}, which is not one of kvstream's metrics"
            assert name in exported, (f"{where} names {name}, which kvstream does not export; exported: "
                                      f"{sorted(n for n in exported if n.startswith(PREFIX))}")
    # and the dashboard shows what operators asked for: capacity, usage, evictions, hits, misses, latencies
    dash_names = {n for where, q in dashboard_queries() for n in _names(where, q)}
    for wanted in ("capacity_bytes", "used_bytes", "chunks", "num_evicted_chunks_total", "num_hit_chunks_total",
                   "num_miss_chunks_total", "time_to_chunk_bucket", "time_to_get_bucket", "time_to_put_bucket",
                   "num_written_bytes_total", "tier_circuit_open", "time_to_write_bucket"):
        assert PREFIX + wanted in dash_names, f"no dashboard panel shows {PREFIX + wanted}"
