"""deploy/monitoring: the Prometheus scrape configs reach every service that exports metrics, and the Grafana
dashboard parses and asks only for series the code exports (their names taken from the code's own registries, fed
with sample data, not from a list kept by hand)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.engine.metrics import RequestMetrics, StatsCollector
from app.jobs.distributed.monitoring import NODE_BUCKETS, ExportLeader, JobCounts, PlatformCollector
from app.jobs.distributed.worker_metrics import WorkerMetrics
from app.serving.backends.base import EngineStats
from app.serving.metrics import EngineSnapshot, InProcessEngineCollector, ServingMetrics

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
MONITORING = DEPLOY / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "inf-engine.json"
# the vLLM series DESIGN.md promises (docs/design: "Interfaces to match"), as Prometheus stores them
DESIGN_VLLM = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
]


class _Redis:
    """What PlatformCollector reads from Redis, with one node kind and one rate-limited endpoint."""

    @contextmanager
    def pipeline(self, transaction: bool = False) -> Iterator[_Redis]:
        self._lengths: list[int] = []
        yield self

    def llen(self, key: str) -> None:
        self._lengths.append(1)

    def execute(self) -> list[int]:
        return self._lengths

    def smembers(self, key: str) -> set[bytes]:
        return {b"llm"}

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        if key.endswith("rate_waits"):
            return {b"count:openai:m@http://x": b"2", b"seconds:openai:m@http://x": b"0.5"}
        return {repr(NODE_BUCKETS[0]).encode(): b"1", b"sum": b"0.004", b"count": b"1"}

    def eval(self, *args: Any) -> int:
        return 1  # this replica holds the leader lock


def _engine_stats() -> Any:
    collector = StatsCollector()
    metrics = RequestMetrics(arrival_time=0.0, num_prompt_tokens=4)
    metrics.on_scheduled(0.01)
    metrics.on_tokens(0.02, 1)
    collector.record_first_token(metrics)
    collector.record_step(1, [])
    metrics.finished_time = 0.1
    collector.record_finished(metrics, ["stop"])
    return collector.snapshot(num_requests_running=0, num_requests_waiting=0, kv_cache_usage_perc=0.0,
                              prefix_cache_queries=4, prefix_cache_hits=0, num_preemptions=0)


def _names(registry: CollectorRegistry) -> set[str]:
    return {s.name for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}


def exported_names() -> set[str]:
    """Every series name the API's /metrics and a worker's /metrics export, from the code's own collectors."""
    api = ServingMetrics("m", lambda: EngineStats(eviction_policy="lru"))
    api.observe_ttft(0.1)
    api.observe_itl(0.01)
    api.observe_queue_time(0.01)
    api.observe_finished(e2e=0.2, prompt_tokens=3, generation_tokens=2, reason="stop")
    api.observe_http("/v1/chat/completions", "POST", 200, 0.2)
    leader = ExportLeader(lambda: _Redis(), "p:metrics:leader")  # type: ignore[arg-type,return-value]
    api.registry.register(PlatformCollector(
        lambda: JobCounts({"running": 1}, {"completed": 1}, {"team": {"pending": 1, "running": 1}}),
        lambda: _Redis(), "p", {"p.cpu": ["p:celery:p.cpu"]}, ["running"], ["team"], leader,  # type: ignore[arg-type,return-value]
    ))
    worker = WorkerMetrics()
    worker.registry.register(InProcessEngineCollector(lambda: [EngineSnapshot.of_engine("m", _engine_stats())]))
    worker.describe(role="engine", pool="threads", queues=["inf.engine"], slots=1)
    worker.task_started("inf.run_node")
    worker.task_finished("inf.run_node", "SUCCESS")
    worker.node_finished("llm", 0.1)
    leader.release()
    return _names(api.registry) | _names(worker.registry)


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


_SERIES = re.compile(r"(?<![\w:])((?:vllm:|inf_engine_|http_|process_|python_)[A-Za-z0-9_:]*)")


def test_the_exported_names_include_what_design_promises() -> None:
    names = exported_names()
    assert set(DESIGN_VLLM) <= names
    assert {"inf_engine_jobs", "inf_engine_queue_depth", "inf_engine_node_latency_seconds_bucket",
            "inf_engine_metrics_leader", "inf_engine_worker_tasks_total", "inf_engine_worker_info"} <= names


def test_the_dashboard_asks_only_for_series_the_code_exports() -> None:
    dashboard = _dashboard()
    names = exported_names()
    used = {name for expr in _exprs(dashboard) for name in _SERIES.findall(expr)}
    assert used, "no series found in the dashboard"
    assert used <= names, sorted(used - names)
    assert set(DESIGN_VLLM) <= used  # every vLLM series DESIGN promises has a panel
    for prefix in ("inf_engine_jobs", "inf_engine_queue_depth", "inf_engine_worker_", "http_request"):
        assert any(name.startswith(prefix) for name in used), prefix
    template = dashboard["templating"]["list"]
    model = next(v for v in template if v["name"] == "model")
    assert _SERIES.findall(model["definition"])[0] in names


def test_the_regex_finds_series_names() -> None:
    expr = 'sum(rate(vllm:prompt_tokens_total{model_name=~"$model"}[5m])) / inf_engine_jobs and on (x) http_x'
    assert _SERIES.findall(expr) == ["vllm:prompt_tokens_total", "inf_engine_jobs", "http_x"]


def test_the_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "inf-engine" and dashboard["title"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:  # no two panels on the same cell of the 24-column grid
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & mine, panel["title"]
        cells |= mine
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    for expr in _exprs(dashboard):
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), expr
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", expr
        assert expr.count("rate(") == len(re.findall(r"rate\([^()]*\[\$__rate_interval\]\)", expr)), expr
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert names == {"datasource", "model"}


def test_prometheus_scrapes_every_compose_service_that_exports_metrics() -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    targets: dict[str, int] = {}
    for job in config["scrape_configs"]:
        assert job["metrics_path"] == "/metrics"
        for sd in job["dns_sd_configs"]:
            assert sd["type"] == "A"
            targets.update(dict.fromkeys(sd["names"], sd["port"]))
    assert targets == {"api": 8000, "worker": 9090, "engine-worker": 9090, "engine-worker-gpu": 9090}
    assert "8000:8000" in compose["api"]["ports"]
    for name in ("worker", "engine-worker", "engine-worker-gpu"):
        assert int(compose[name]["environment"]["INF_ENGINE_WORKER_METRICS_PORT"]) == targets[name]
    volumes = compose["prometheus"]["volumes"]
    assert "./monitoring/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in volumes


def test_prometheus_in_kubernetes_follows_the_pod_annotations() -> None:
    config = yaml.safe_load((MONITORING / "prometheus-kubernetes.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == ["inf-engine"]
    relabel = job["relabel_configs"]
    keep = relabel[0]
    assert keep == {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
                    "action": "keep", "regex": "true"}
    address = next(r for r in relabel if r.get("target_label") == "__address__")
    # the annotated port replaces the discovered one
    pattern = re.compile(address["regex"])
    match = pattern.fullmatch("10.1.2.3:8000;9090")
    assert match and match.expand(address["replacement"].replace("$", "\\")) == "10.1.2.3:9090"
    annotated = []
    for path in sorted((DEPLOY / "k8s" / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in {"Deployment", "StatefulSet"}:
                template = doc["spec"]["template"]
                annotations = template["metadata"].get("annotations", {})
                if annotations.get("prometheus.io/scrape") == "true":
                    ports = {p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
                    assert int(annotations["prometheus.io/port"]) in ports, doc["metadata"]["name"]
                    annotated.append(doc["metadata"]["name"])
    assert sorted(annotated) == ["api", "engine-worker", "worker"]


def test_grafana_provisioning_matches_the_compose_mounts() -> None:
    grafana = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["grafana"]
    mounts = dict(m.rsplit(":", 1)[0].split(":", 1) for m in grafana["volumes"])
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/inf-engine.yml").read_text())
    (dashboards,) = provider["providers"]
    assert mounts["./monitoring/grafana/dashboards"] == dashboards["options"]["path"]
    assert mounts["./monitoring/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].startswith(dashboards["options"]["path"])
    source = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (prometheus,) = source["datasources"]
    assert prometheus["type"] == "prometheus" and prometheus["url"] == "http://prometheus:9090"


#: what Grafana puts in place of the dashboard's variables before Prometheus sees a query
_GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model": "SmolLM2-135M-Instruct", "${datasource}": "prometheus"}


def test_every_dashboard_query_is_valid_promql() -> None:
    """Each panel's query, with Grafana's variables filled in, parses as PromQL (promql-parser, the Rust port of
    Prometheus's own parser), so a typo cannot reach a deployed dashboard."""
    promql_parser = pytest.importorskip("promql_parser")
    exprs = _exprs(_dashboard())
    assert exprs
    for expr in exprs:
        query = expr
        for variable, value in _GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        assert "$" not in query, f"a Grafana variable without a value here: {expr}"
        promql_parser.parse(query)  # raises on a syntax error
    with pytest.raises(ValueError):  # the check has teeth
        promql_parser.parse("sum(rate(vllm:prompt_tokens_total[1m])")
