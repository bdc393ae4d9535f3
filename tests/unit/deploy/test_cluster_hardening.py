"""Issue 35, the cluster: generated secrets (no placeholder is ever applied), Redis behind a password and network
policies, disruption budgets, the workers' metrics endpoints and their PodMonitors, and a compose file that will
not publish an open API. Offline: kustomize renders, kubernetes-validate checks, the policies are evaluated here."""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from app.jobs.tenants import KeyRing
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
REDIS_URL = "redis://:$(REDIS_PASSWORD)@redis:6379/0"
SECRETS = {"postgres-password": "postgres.env", "redis-password": "redis.env", "flower-password": "flower.env",
           "api-keys": "api-keys.env"}


def _kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}}


def _secret_values(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Generated Secret (name without its hash) -> its one value."""
    out = {}
    for name, secret in _kind(docs, "Secret").items():
        (value,) = secret["data"].values()
        out[name.rsplit("-", 1)[0]] = base64.b64decode(value).decode()
    return out


# -- secrets --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", ["", "gpu"])
def test_without_the_secret_files_kustomize_refuses_to_build(
    bare_k8s: Path, kustomize_build: Callable[[Path], subprocess.CompletedProcess[str]], profile: str
) -> None:
    """Nothing committed can be applied as a secret: the operator's files are missing, so the build stops."""
    result = kustomize_build(bare_k8s / profile)
    assert result.returncode != 0
    assert ".env" in result.stderr and ("no such file" in result.stderr or "not found" in result.stderr), result.stderr


def test_nothing_applied_or_committed_holds_a_placeholder(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for profile, docs in rendered.items():
        text = yaml.safe_dump_all(docs)
        assert "change-me" not in text.lower(), profile
        values = _secret_values(docs)
        assert set(values) == set(SECRETS)
        assert len(set(values.values())) == 4  # four random values
    committed = subprocess.run(["git", "ls-files", "deploy"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in committed.stdout.split():
        path = ROOT / name
        if path.is_file() and path.suffix in {".yaml", ".yml", ".env", ".json", ".sh", ".md", ".example", ""}:
            assert "change-me" not in path.read_text(errors="replace").lower(), name
    assert not (K8S / "base" / "secret.yaml").exists()


def test_generate_sh_writes_random_private_files_and_never_overwrites(bare_k8s: Path) -> None:
    folder = bare_k8s / "secrets"
    first = subprocess.run(["bash", str(folder / "generate.sh")], capture_output=True, text=True, check=True)
    assert first.stdout.count("wrote") == 4
    contents = {name: (folder / name).read_text() for name in SECRETS.values()}
    for name in ("postgres.env", "redis.env", "flower.env"):
        assert re.fullmatch(r"password=[0-9a-f]{48}\n", contents[name]), name
    assert re.fullmatch(r"keys=default:sk-[0-9a-f]{48}\n", contents["api-keys.env"])
    ring = KeyRing(Settings(api_keys=contents["api-keys.env"].strip().split("=", 1)[1]).api_keys)  # type: ignore[arg-type]
    assert [e.tenant for e in ring.entries] == ["default"]
    for name in SECRETS.values():
        assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o600, name
    again = subprocess.run(["bash", str(folder / "generate.sh")], capture_output=True, text=True, check=True)
    assert again.stdout.count("kept") == 4
    assert {name: (folder / name).read_text() for name in SECRETS.values()} == contents


def test_the_secret_files_are_git_ignored_and_the_example_is_not() -> None:
    def ignored(path: str) -> bool:
        result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, check=False)
        return result.returncode == 0

    for name in SECRETS.values():
        assert ignored(f"deploy/k8s/secrets/{name}"), name
    assert ignored("deploy/.env")
    assert not ignored("deploy/k8s/secrets/example.env") and not ignored("deploy/env.example")


def test_the_generator_makes_the_secrets_the_pods_reference(rendered: dict[str, list[dict[str, Any]]]) -> None:
    component = yaml.safe_load((K8S / "secrets" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    generated = {g["name"]: g for g in component["secretGenerator"]}
    assert {name: g["envs"] for name, g in generated.items()} == {n: [f] for n, f in SECRETS.items()}
    assert {g["namespace"] for g in generated.values()} == {"inf-engine"}  # beside the pods that use them
    for path in (K8S / "kustomization.yaml", K8S / "gpu" / "kustomization.yaml"):
        components = yaml.safe_load(path.read_text())["components"]
        assert [(path.parent / c).resolve() for c in components] == [(K8S / "secrets").resolve()], path
    names = set(_kind(rendered["cpu"], "Secret"))
    assert all(re.fullmatch(r"[a-z-]+-[a-z0-9]{10}", n) for n in names)  # hashed: a new value rolls the pods


# -- Redis: a password, in every client's URL -----------------------------------------------------------------------
def _env(container: dict[str, Any]) -> list[dict[str, Any]]:
    return list(container.get("env", []))


def test_redis_requires_the_password_of_its_secret(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cpu"]
    container = _workloads(docs)["redis"]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _env(container)}
    redis_secret = next(n for n in _kind(docs, "Secret") if n.startswith("redis-password-"))
    assert env["REDIS_PASSWORD"] == env["REDISCLI_AUTH"] == {"name": redis_secret, "key": "password"}
    for probe in ("readinessProbe", "livenessProbe"):  # redis-cli authenticates with REDISCLI_AUTH
        assert container[probe]["exec"]["command"] == ["redis-cli", "ping"]


def test_every_redis_client_gets_the_password_through_its_url(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cpu"]
    password = _secret_values(docs)["redis-password"]
    redis_secret = next(n for n in _kind(docs, "Secret") if n.startswith("redis-password-"))
    service = _kind(docs, "Service")["redis"]
    clients = {}
    for name, workload in _workloads(docs).items():
        container = workload["spec"]["template"]["spec"]["containers"][0]
        if container.get("command", [])[:2] in (["inf-engine", "serve"], ["inf-engine", "worker"], ["inf-engine", "beat"],
                                        ["inf-engine", "flower"]):
            clients[name] = container
    assert set(clients) == {"api", "worker", "engine-worker", "beat", "flower"}
    for name, container in clients.items():
        names = [e["name"] for e in _env(container)]
        url = next(e["value"] for e in _env(container) if e["name"] == "INF_ENGINE_REDIS_URL")
        assert url == REDIS_URL, name
        # $(REDIS_PASSWORD) is expanded by the kubelet only when the variable comes earlier in the list
        assert names.index("REDIS_PASSWORD") < names.index("INF_ENGINE_REDIS_URL"), name
        ref = next(e for e in _env(container) if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": redis_secret, "key": "password"}, name
    expanded = REDIS_URL.replace("$(REDIS_PASSWORD)", password)
    settings = Settings(redis_url=expanded)
    options = redis.Redis.from_url(settings.redis_url or "").connection_pool.connection_kwargs
    assert (options["password"], options["host"], options["port"]) == (password, "redis", 6379)
    assert service["spec"]["ports"][0]["port"] == 6379 and service["spec"]["selector"] == {"app": "redis"}
    assert "redis" not in _kind(docs, "ConfigMap")["inf-engine-config"]["data"].get("INF_ENGINE_REDIS_URL", "")


# -- NetworkPolicy, evaluated -----------------------------------------------------------------------------------
def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, op, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _admits(policies: list[dict[str, Any]], source: dict[str, Any], target: dict[str, str], port: int) -> bool:
    """Kubernetes' ingress semantics: a pod no policy selects takes anything; a selected pod takes what one rule of
    one selecting policy allows. ``source``: {"namespace", "labels"} for a pod, {"ip"} for a client outside."""
    selecting = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], target)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and not any(p["port"] == port for p in rule["ports"]):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                if "ipBlock" in peer:
                    if "ip" in source and ipaddress.ip_address(source["ip"]) in ipaddress.ip_network(peer["ipBlock"]["cidr"]):
                        return True
                    continue
                if "ip" in source:
                    continue
                namespace_ok = (source["namespace"] == policy["metadata"]["namespace"]
                                if "namespaceSelector" not in peer
                                else _selects(peer["namespaceSelector"],
                                              {"kubernetes.io/metadata.name": source["namespace"]}))
                if namespace_ok and _selects(peer.get("podSelector", {}), source["labels"]):
                    return True
    return False


def test_network_policies_keep_redis_and_postgres_inside_and_the_api_open(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["cpu"]
    policies = list(_kind(docs, "NetworkPolicy").values())
    pods = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in _workloads(docs).items()}
    assert set(pods) == {"api", "worker", "engine-worker", "beat", "flower", "redis", "postgres"}
    inside = {name: {"namespace": "inf-engine", "labels": labels} for name, labels in pods.items()}
    intruders = {
        "another namespace's pod named like ours": {"namespace": "default", "labels": {"app": "api"}},
        "an unlabelled pod of the namespace": {"namespace": "inf-engine", "labels": {}},
        "a client outside the cluster": {"ip": "203.0.113.7"},
    }

    def reaches(source: dict[str, Any], target: str, port: int) -> bool:
        return _admits(policies, source, pods[target], port)

    redis_clients = {"api", "worker", "engine-worker", "beat", "flower"}
    database_clients = {"api", "worker", "engine-worker", "beat"}
    for name, source in inside.items():
        assert reaches(source, "redis", 6379) == (name in redis_clients), name
        assert reaches(source, "postgres", 5432) == (name in database_clients), name
    for what, source in intruders.items():
        assert not reaches(source, "redis", 6379), what
        assert not reaches(source, "postgres", 5432), what
        assert reaches(source, "api", 8000), what  # the public entry
        assert not reaches(source, "api", 9999), what
        assert not reaches(source, "beat", 9090), what  # beat listens on nothing
        for scraped in ("worker", "engine-worker"):  # Prometheus, wherever it runs
            assert reaches(source, scraped, 9090), (what, scraped)
            assert not reaches(source, scraped, 6379), (what, scraped)
    assert reaches(intruders["a client outside the cluster"], "flower", 5555)  # behind basic auth
    default_deny = _kind(docs, "NetworkPolicy")["default-deny-ingress"]["spec"]
    assert default_deny == {"podSelector": {}, "policyTypes": ["Ingress"]}  # every pod, nothing allowed by it
    for policy in policies:
        assert "Egress" not in policy["spec"]["policyTypes"]  # workers call remote LLMs; everybody needs DNS


def test_the_policy_check_would_catch_an_open_redis(rendered: dict[str, list[dict[str, Any]]]) -> None:
    policies = [p for p in _kind(rendered["cpu"], "NetworkPolicy").values()
                if p["metadata"]["name"] not in {"default-deny-ingress", "redis-ingress"}]
    assert _admits(policies, {"ip": "203.0.113.7"}, {"app": "redis"}, 6379)


# -- PodDisruptionBudgets -------------------------------------------------------------------------------------------
def test_disruption_budgets_keep_the_api_up_and_never_block_a_drain(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cpu"]
    budgets = _kind(docs, "PodDisruptionBudget")
    workloads = _workloads(docs)
    covered = {}
    for name, budget in budgets.items():
        spec = budget["spec"]
        (target,) = [w for w, d in workloads.items() if _selects(spec["selector"], d["spec"]["template"]["metadata"]["labels"])]
        covered[target] = spec
        replicas = workloads[target]["spec"]["replicas"]
        if "minAvailable" in spec:
            assert 0 < spec["minAvailable"] < replicas, name  # one pod at a time may go
        else:
            assert spec["maxUnavailable"] >= 1, name
        assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow", name
    assert set(covered) == {"api", "worker", "engine-worker"}
    assert covered["api"]["minAvailable"] == 1 and workloads["api"]["spec"]["replicas"] >= 2


# -- metrics: the workers' endpoints and who scrapes them ----------------------------------------------------------
def test_workers_serve_metrics_on_a_named_port(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cpu"]
    config = _kind(docs, "ConfigMap")["inf-engine-config"]["data"]
    port = int(config["INF_ENGINE_WORKER_METRICS_PORT"])
    assert Settings(worker_metrics_port=config["INF_ENGINE_WORKER_METRICS_PORT"]).worker_metrics_port == port  # type: ignore[arg-type]
    assert Settings().worker_metrics_address == "0.0.0.0"  # reachable in the pod's network
    for name in ("worker", "engine-worker"):
        template = _workloads(docs)[name]["spec"]["template"]
        container = template["spec"]["containers"][0]
        assert {"name": "metrics", "containerPort": port} in container["ports"], name
        annotations = template["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                               "prometheus.io/path": "/metrics"}, name
    api = _workloads(docs)["api"]["spec"]["template"]
    assert {"name": "http", "containerPort": 8000} in api["spec"]["containers"][0]["ports"]
    assert api["metadata"]["annotations"]["prometheus.io/port"] == "8000"


# the PodMonitor fields used here, as the Prometheus Operator's monitoring.coreos.com/v1 CRD defines them
POD_MONITOR_SPEC = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
POD_METRICS_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings"}


def test_pod_monitors_scrape_every_api_replica_and_worker_on_their_ports(
    rendered: dict[str, list[dict[str, Any]]], render_k8s: Callable[[Path], list[dict[str, Any]]],
) -> None:
    """kubectl apply -k deploy/k8s/monitoring (with the Prometheus Operator): kept out of deploy/k8s, whose apply
    must not need the operator's CRDs."""
    monitors = render_k8s(K8S / "monitoring")
    assert {d["kind"] for d in monitors} == {"PodMonitor"}
    assert not any(d["kind"] == "PodMonitor" for d in rendered["cpu"])
    pods = {name: w["spec"]["template"] for name, w in _workloads(rendered["cpu"]).items()}
    scraped = {}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["namespace"] == "inf-engine"
        spec = monitor["spec"]
        assert set(spec) <= POD_MONITOR_SPEC, set(spec) - POD_MONITOR_SPEC
        selected = {name for name, t in pods.items() if _selects(spec["selector"], t["metadata"]["labels"])}
        for endpoint in spec["podMetricsEndpoints"]:
            assert set(endpoint) <= POD_METRICS_ENDPOINT, set(endpoint) - POD_METRICS_ENDPOINT
            assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+[sm]", endpoint["interval"])
            for name in selected:
                port_names = {p.get("name") for p in pods[name]["spec"]["containers"][0].get("ports", [])}
                assert endpoint["port"] in port_names, (monitor["metadata"]["name"], name)
        scraped[monitor["metadata"]["name"]] = selected
    assert scraped == {"inf-engine-api": {"api"}, "inf-engine-workers": {"worker", "engine-worker"}}


# -- docker compose: the published API needs keys ---------------------------------------------------------------
_VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::([?-])([^}]*))?\}")


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} (unset or empty counts as missing)."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        return arg if op == "-" else ""

    return _VARIABLE.sub(one, value)


def test_compose_refuses_to_publish_the_api_without_keys() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    api = services["api"]
    assert "8000:8000" in api["ports"]
    keys = api["environment"]["INF_ENGINE_API_KEYS"]
    for missing in ({}, {"INF_ENGINE_API_KEYS": ""}):
        with pytest.raises(ValueError, match="INF_ENGINE_API_KEYS"):
            _interpolate(keys, missing)
    assert _interpolate(keys, {"INF_ENGINE_API_KEYS": "team:sk-1"}) == "team:sk-1"
    assert Settings(api_keys="team:sk-1,sk-2").api_keys == ["team:sk-1", "sk-2"]  # type: ignore[arg-type]
    for name, service in services.items():  # the keys go to the API alone
        if name != "api":
            assert "INF_ENGINE_API_KEYS" not in (service.get("environment") or {}), name
    example = dict(line.split("=", 1) for line in (DEPLOY / "env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert example["INF_ENGINE_API_KEYS"] == ""  # an example with no key in it: compose stops until you add one
    assert "--env-file deploy/.env" in (DEPLOY / "README.md").read_text()


def test_compose_workers_serve_metrics_and_monitoring_is_opt_in_and_local() -> None:
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    for name in ("worker", "engine-worker", "engine-worker-gpu"):
        assert services[name]["environment"]["INF_ENGINE_WORKER_METRICS_PORT"] == "9090", name
    for name in ("prometheus", "grafana"):
        service = services[name]
        assert service["profiles"] == ["monitoring"], name
        assert all(port.startswith("127.0.0.1:") for port in service["ports"]), name
        for mount in service["volumes"]:
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_DISABLE_LOGIN_FORM"] == "true" and grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
