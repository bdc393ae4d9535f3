"""What the deployment tests share: deploy/k8s rendered by kustomize, from a copy whose secret files
deploy/k8s/secrets/generate.sh wrote (the checkout's own are never read)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"


def kustomize_command() -> list[str] | None:
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    return None


def kustomize(folder: Path) -> subprocess.CompletedProcess[str]:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kubectl nor kustomize is installed")
    return subprocess.run([*command, str(folder)], capture_output=True, text=True, timeout=120, check=False)


def render(folder: Path) -> list[dict[str, Any]]:
    result = kustomize(folder)
    assert result.returncode == 0, f"kustomize {folder}: {result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def copy_without_secrets(target: Path) -> Path:
    """deploy/k8s as committed: without the secret files an operator may have created in this checkout."""
    shutil.copytree(K8S, target, ignore=lambda folder, names: [
        n for n in names if Path(folder).name == "secrets" and n.endswith(".env") and n != "example.env"
    ])
    return target


@pytest.fixture(scope="module")
def k8s_with_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s whose secret files deploy/k8s/secrets/generate.sh wrote, as an operator would."""
    k8s = copy_without_secrets(tmp_path_factory.mktemp("deploy") / "k8s")
    subprocess.run(["bash", str(k8s / "secrets" / "generate.sh")], check=True, capture_output=True, timeout=60)
    return k8s


@pytest.fixture(scope="module")
def rendered(k8s_with_secrets: Path) -> dict[str, list[dict[str, Any]]]:
    """`kubectl kustomize` of both profiles (what `kubectl apply -k` applies)."""
    return {"cpu": render(k8s_with_secrets), "gpu": render(k8s_with_secrets / "gpu")}


@pytest.fixture
def render_k8s() -> Callable[[Path], list[dict[str, Any]]]:
    return render


@pytest.fixture
def kustomize_build() -> Callable[[Path], subprocess.CompletedProcess[str]]:
    return kustomize


@pytest.fixture
def bare_k8s(tmp_path: Path) -> Path:
    """A copy of deploy/k8s as committed: no secret files."""
    return copy_without_secrets(tmp_path / "k8s")
