"""The compose file and Kubernetes manifests parse, run only inf-engine commands, and probe their services."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from app.cli import app as cli

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"  # the manifests; deploy/k8s (CPU) and deploy/k8s/gpu are overlays of it
CLI_COMMANDS = {c.name for c in cli.registered_commands} | {g.name for g in cli.registered_groups}


def _inf_engine_command(command: list[str]) -> str:
    """The subcommand a container runs; it must be one the CLI has."""
    assert command[0] == "inf-engine", command
    assert command[1] in CLI_COMMANDS, f"{command[1]} is not an inf-engine command"
    return command[1]


def test_the_cli_has_the_commands_the_deployment_uses() -> None:
    assert {"serve", "worker", "beat", "flower"} <= CLI_COMMANDS


def test_compose_services_run_cli_commands() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {
        "postgres", "redis", "migrate", "api", "worker", "engine-worker", "engine-worker-gpu", "beat", "flower",
        "prometheus", "grafana",
    }
    roles = {
        name: _inf_engine_command(s["command"])
        for name, s in services.items()
        if "image" in s and "inf" in s["image"]
    }
    assert roles == {
        "migrate": "db",
        "api": "serve",
        "worker": "worker",
        "engine-worker": "worker",
        "engine-worker-gpu": "worker",
        "beat": "beat",
        "flower": "flower",
    }
    assert "--engine" in services["engine-worker"]["command"]
    assert "noeviction" in services["redis"]["command"]
    for name, service in services.items():
        if name != "migrate":  # a one-shot job
            assert "healthcheck" in service, f"{name} has no healthcheck"
    assert "/ready" in " ".join(services["api"]["healthcheck"]["test"])  # the database at head, not only alive
    env = services["api"]["environment"]
    assert env["INF_ENGINE_REDIS_URL"].startswith("redis://redis:")
    assert float(env["INF_ENGINE_CELERY_VISIBILITY_TIMEOUT"]) > float(
        env["INF_ENGINE_CELERY_TASK_TIME_LIMIT"]
    )


def _k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(BASE.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _containers(kind: str) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
        for d in _k8s_documents()
        if d["kind"] == kind
    }


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    files = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert kustomization["namespace"] == "inf-engine"
    # deploy/k8s (kubectl apply -k deploy/k8s) is the base as it is, with the generated Secrets: the CPU profile
    top = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert top["resources"] == ["base"]
    assert top["components"] == ["secrets"]
    assert set(top) == {"apiVersion", "kind", "resources", "components"}
    assert {p.name for p in K8S.glob("*.yaml")} == {"kustomization.yaml"}  # no manifest left outside base/
    assert not any(d["kind"] == "Secret" for d in _k8s_documents())  # no committed Secret: they are generated


# -- kustomize: no kustomization may list a folder above it ---------------------------------------------------------
def _kustomization_cycles(root: Path) -> list[str]:
    """Walk every kustomization under root through its folder resources as kustomize does; what it would reject.

    kustomize refuses a resource folder that is, or contains, a kustomization root already being built ("cycle
    detected: candidate root ... contains visited root"): an overlay listing `..`, its own parent, is one.
    """
    problems: list[str] = []

    def visit(folder: Path, visited: tuple[Path, ...]) -> None:
        kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text()) or {}
        for resource in kustomization.get("resources", []):
            candidate = (folder / resource).resolve()
            if candidate.is_file():
                continue
            if not (candidate / "kustomization.yaml").is_file():
                problems.append(f"{folder.relative_to(root)}: {resource} is neither a file nor a kustomization")
                continue
            if any(v == candidate or candidate in v.parents for v in visited):
                problems.append(f"{folder.relative_to(root)}: {resource} contains a folder being built (a cycle)")
                continue
            visit(candidate, (*visited, candidate))

    for path in sorted(root.rglob("kustomization.yaml")):
        visit(path.parent.resolve(), (path.parent.resolve(),))
    return problems


def test_no_kustomization_lists_an_ancestor_folder() -> None:
    """Runs without kubectl: the structure `kubectl apply -k deploy/k8s/gpu` needs (kustomize 5 rejects `..`)."""
    assert _kustomization_cycles(K8S) == []
    for path in K8S.rglob("kustomization.yaml"):
        for resource in yaml.safe_load(path.read_text()).get("resources", []):
            target = (path.parent / resource).resolve()
            assert target not in path.parent.resolve().parents and target != path.parent.resolve(), (path, resource)


def test_the_cycle_check_would_catch_an_overlay_of_its_parent(tmp_path: Path) -> None:
    (tmp_path / "gpu").mkdir()
    (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\n")
    (tmp_path / "a.yaml").write_text("kind: ConfigMap\n")
    (tmp_path / "gpu" / "kustomization.yaml").write_text("resources: ['..']\n")
    assert _kustomization_cycles(tmp_path) == ["gpu: .. contains a folder being built (a cycle)"]


def _by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_both_kustomizations_render_and_gpu_changes_only_the_engine_worker(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """`kubectl kustomize deploy/k8s` and `deploy/k8s/gpu` build (what `kubectl apply -k` runs first)."""
    import kubernetes_validate

    cpu = _by_key(rendered["cpu"])
    gpu = _by_key(rendered["gpu"])
    manifests = [d for d in _k8s_documents() if d["kind"] != "Kustomization"]
    secrets = {key for key in cpu if key[0] == "Secret"}
    assert set(cpu) == set(gpu) == set(_by_key(manifests)) | secrets
    for (kind, _), doc in cpu.items():
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == "inf-engine", doc["metadata"]
        kubernetes_validate.validate(doc, "1.31.0", strict=True)
    engine = ("Deployment", "engine-worker")
    assert {key for key in cpu if cpu[key] != gpu[key]} == {engine}
    cpu_spec, gpu_spec = cpu[engine]["spec"]["template"]["spec"], gpu[engine]["spec"]["template"]["spec"]
    assert cpu_spec["containers"][0]["image"] == cpu_spec["initContainers"][0]["image"] == "inf-engine:latest"
    assert gpu_spec["containers"][0]["image"] == gpu_spec["initContainers"][0]["image"] == "inf-engine:gpu"
    resources = gpu_spec["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    assert not any("nvidia.com/gpu" in part for part in cpu_spec["containers"][0]["resources"].values())
    kubernetes_validate.validate(gpu[engine], "1.31.0", strict=True)


def test_k8s_deployments_run_cli_commands_with_probes() -> None:
    deployments = _containers("Deployment")
    roles = {
        name: _inf_engine_command(c["command"])
        for name, c in deployments.items()
        if c["image"] == "inf-engine"
    }
    assert "redis" not in deployments  # a StatefulSet (test_redis_is_a_stateful_set_with_a_volume)
    assert roles == {
        "api": "serve",
        "worker": "worker",
        "engine-worker": "worker",
        "beat": "beat",
        "flower": "flower",
    }
    for name, container in {**deployments, **_containers("StatefulSet")}.items():
        assert "livenessProbe" in container, f"{name} has no liveness probe"
    api = deployments["api"]
    for probe in ("startupProbe", "livenessProbe"):
        assert api[probe]["httpGet"] == {"path": "/health", "port": 8000}
    # readiness: also the database reachable and at the schema's head (a check of up to 2 s, so not the 1 s default)
    assert api["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8000}
    assert api["readinessProbe"]["timeoutSeconds"] >= 3
    assert deployments["flower"]["readinessProbe"]["httpGet"]["path"] == "/healthcheck"


@pytest.mark.parametrize("name", ["worker", "engine-worker"])
def test_worker_probes_ping_their_own_node_name(name: str) -> None:
    container = _containers("Deployment")[name]
    node = next(e["value"] for e in container["env"] if e["name"] == "INF_ENGINE_WORKER_NAME")
    role = node.split("@")[0]
    assert node == f"{role}@%h"
    assert f"-d {role}@$HOSTNAME" in container["livenessProbe"]["exec"]["command"][-1]


def test_beat_never_runs_twice_during_a_rollout() -> None:
    beat = next(d for d in _k8s_documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"


# -- issue 17: what a deployer's cluster needs --------------------------------------------------------------------
def _pod_specs() -> dict[str, dict[str, Any]]:
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
        for d in _k8s_documents()
        if d["kind"] in {"Deployment", "StatefulSet", "Job", "DaemonSet"}
    }


def test_every_manifest_validates_against_the_kubernetes_schemas() -> None:
    """Offline, strict (unknown fields are errors), with kubernetes-validate's bundled schemas."""
    import kubernetes_validate

    docs = _k8s_documents()
    assert len(docs) >= 15
    for doc in docs:
        if doc["kind"] == "Kustomization":
            continue
        kubernetes_validate.validate(doc, "1.31.0", strict=True)


def test_the_validator_would_catch_a_broken_manifest() -> None:
    import kubernetes_validate

    bad = next(d for d in _k8s_documents() if d["kind"] == "Deployment")
    bad = {**bad, "spec": {**bad["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.31.0", strict=True)


def test_every_container_has_cpu_and_memory_requests_and_limits() -> None:
    for owner, spec in _pod_specs().items():
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            resources = container.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(part, {})), f"{owner}/{container['name']} {part}"


def test_migrations_run_in_an_init_container_not_in_every_api_replica() -> None:
    config = next(d for d in _k8s_documents() if d["kind"] == "ConfigMap")
    assert config["data"]["INF_ENGINE_DB_AUTO_UPGRADE"] == "false"
    api = _pod_specs()["Deployment/api"]
    (migrate,) = api["initContainers"]
    assert migrate["command"] == ["inf-engine", "db", "upgrade"]
    for owner, spec in _pod_specs().items():
        if owner != "Deployment/api":
            assert "initContainers" not in spec or all(
                c["command"][:3] != ["inf-engine", "db", "upgrade"] for c in spec["initContainers"]
            )


@pytest.mark.parametrize("name", ["worker", "engine-worker", "beat"])
def test_workers_and_beat_wait_for_the_schema_instead_of_crash_looping(name: str) -> None:
    spec = _pod_specs()[f"Deployment/{name}"]
    (wait,) = spec["initContainers"]
    command = wait["command"]
    assert command[:4] == ["inf-engine", "db", "check", "--wait"] and float(command[4]) >= 300
    assert "check" in {c.name for g in cli.registered_groups if g.name == "db" for c in g.typer_instance.registered_commands}
    assert wait["image"] == spec["containers"][0]["image"]
    assert wait["envFrom"] == spec["containers"][0]["envFrom"]
    assert any(e["name"] == "INF_ENGINE_DATABASE_PASSWORD" for e in wait["env"])
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    if name in compose:
        assert compose[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_redis_is_a_stateful_set_with_a_volume_and_noeviction() -> None:
    (redis,) = [d for d in _k8s_documents() if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "redis"]
    container = redis["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--appendonly") + 1] == "yes"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
    assert "volumes" not in redis["spec"]["template"]["spec"]  # no emptyDir left


def test_beat_liveness_reads_its_own_heartbeat() -> None:
    beat = _containers("Deployment")["beat"]
    assert beat["livenessProbe"]["exec"]["command"] == ["inf-engine", "beat", "--check"]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert compose["services"]["beat"]["healthcheck"]["test"] == ["CMD", "inf-engine", "beat", "--check"]


def test_one_secret_per_value_and_no_password_in_a_url(rendered: dict[str, list[dict[str, Any]]]) -> None:
    import base64

    docs = rendered["cpu"]
    secrets = [d for d in docs if d["kind"] == "Secret"]
    assert {s["metadata"]["name"].rsplit("-", 1)[0] for s in secrets} == {
        "postgres-password", "redis-password", "flower-password", "api-keys",
    }
    for secret in secrets:
        assert len(secret.get("stringData", {})) + len(secret.get("data", {})) == 1, secret["metadata"]["name"]
        assert secret["metadata"]["namespace"] == "inf-engine"
    values = [base64.b64decode(v).decode() for s in secrets for v in s["data"].values()]
    texts = [yaml.safe_dump(d) for d in docs if d["kind"] != "Secret"]
    for value in set(values):
        assert not any(value in text for text in texts), "a secret value written outside its Secret"
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert "@" in config["data"]["INF_ENGINE_DATABASE_URL"] and ":" not in config["data"]["INF_ENGINE_DATABASE_URL"].split("//")[1].split("@")[0]
    assert "INF_ENGINE_REDIS_URL" not in config["data"]  # each client's URL carries the password (from its Secret)
    referenced = {
        ref["secretKeyRef"]["name"]
        for d in docs if d["kind"] in {"Deployment", "StatefulSet"}
        for c in [*d["spec"]["template"]["spec"].get("initContainers", []), *d["spec"]["template"]["spec"]["containers"]]
        for ref in (e.get("valueFrom", {}) for e in c.get("env", []))
        if "secretKeyRef" in ref
    }
    assert referenced == {s["metadata"]["name"] for s in secrets}  # the generated (hashed) names, every one used


def test_engine_worker_is_cpu_by_default_and_gpu_is_opt_in() -> None:
    engine = _containers("Deployment")["engine-worker"]
    assert not any("nvidia.com/gpu" in part for part in engine["resources"].values())
    overlay = yaml.safe_load((K8S / "gpu" / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../base"]  # a sibling of deploy/k8s's own kustomization, not ".."
    (patch,) = overlay["patches"]
    assert patch["target"]["name"] == "engine-worker"
    ops = yaml.safe_load(patch["patch"])
    assert {"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": "inf-engine:gpu"} in ops
    assert {"op": "replace", "path": "/spec/template/spec/initContainers/0/image", "value": "inf-engine:gpu"} in ops
    assert any(op["path"].endswith("limits/nvidia.com~1gpu") and op["value"] == 1 for op in ops)
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    assert "profiles" not in compose["engine-worker"] and "deploy" not in compose["engine-worker"]
    gpu = compose["engine-worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and "cu" in gpu["build"]["args"]["TORCH_INDEX"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_compose_file_is_consistent() -> None:
    """No Docker here: the compose file is checked by a parser and the structure compose requires."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services, volumes = compose["services"], set(compose.get("volumes") or {})
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert dependency in services and dependency != name, (name, dependency)
            assert condition["condition"] in {"service_started", "service_healthy", "service_completed_successfully"}
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            assert source.startswith((".", "/")) or source in volumes, (name, source)
        assert isinstance(service.get("command", []), list)
    migrate = services["migrate"]
    assert migrate["command"] == ["inf-engine", "db", "upgrade"] and migrate["restart"] == "no"
    for name in ("api", "worker", "engine-worker", "beat", "flower"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["api"]["environment"]["INF_ENGINE_DB_AUTO_UPGRADE"] == "false"
    assert "@postgres" in services["api"]["environment"]["INF_ENGINE_DATABASE_URL"]
    assert ":" not in services["api"]["environment"]["INF_ENGINE_DATABASE_URL"].split("//")[1].split("@")[0]


def test_dockerfile_compiles_the_kernels_and_fails_without_them() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert "gcc" in text and "libgomp1" in text
    assert "from app.engine.kernels import available" in text and "sys.exit(0 if ok else 1)" in text
    assert 'ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu' in text
    # app/db/migrations (package data) is a link to ../../migrations: the image needs both (scripts/image_context.py)
    assert "COPY migrations ./migrations" in text
    assert "from app.db.migrate import migrations_dir" in text  # the build fails without them
    assert '".[engine,flower]"' in text and "pip install" in text
