"""The compose file and Kubernetes manifests parse, run only inf-engine commands, and probe their services."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from app.cli import app as cli

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
CLI_COMMANDS = {c.name for c in cli.registered_commands}


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
    assert set(services) == {"postgres", "redis", "api", "worker", "engine-worker", "beat", "flower"}
    roles = {
        name: _inf_engine_command(s["command"])
        for name, s in services.items()
        if "image" in s and "inf" in s["image"]
    }
    assert roles == {
        "api": "serve",
        "worker": "worker",
        "engine-worker": "worker",
        "beat": "beat",
        "flower": "flower",
    }
    assert "--engine" in services["engine-worker"]["command"]
    assert "noeviction" in services["redis"]["command"]
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
    assert "/health" in " ".join(services["api"]["healthcheck"]["test"])
    env = services["api"]["environment"]
    assert env["INF_ENGINE_REDIS_URL"].startswith("redis://redis:")
    assert float(env["INF_ENGINE_CELERY_VISIBILITY_TIMEOUT"]) > float(
        env["INF_ENGINE_CELERY_TASK_TIME_LIMIT"]
    )


def _k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _containers(kind: str) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
        for d in _k8s_documents()
        if d["kind"] == kind
    }


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_k8s_deployments_run_cli_commands_with_probes() -> None:
    deployments = _containers("Deployment")
    roles = {
        name: _inf_engine_command(c["command"])
        for name, c in deployments.items()
        if c["image"] == "inf-engine"
    }
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
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert api[probe]["httpGet"] == {"path": "/health", "port": 8000}
    assert deployments["flower"]["readinessProbe"]["httpGet"]["path"] == "/healthcheck"
    assert "noeviction" in deployments["redis"]["args"]


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
