"""Two gateways and two schedulers over two nodes, with HAProxy in front as deployed
(deploy/haproxy.cfg): no single gateway is needed.

- a gateway killed with -9 during a burst of creates through the e2b SDK fails none
  of them and makes no extra sandbox: the front sends a create its gateway dropped to
  the other (or answers 502, which the SDK retries), under the create's
  Idempotency-Key, and the gateways send a key where it went first; every sandbox,
  made through either, is served by the one left (API and proxied envd traffic);
- a create's Idempotency-Key makes one sandbox through whichever gateways its tries
  go (the key's node is kept in Redis);
- a create from an image is placed on a node that holds the image, before a less
  loaded one that would pull it again;
- the native clients take several gateway URLs and use the next when one does not
  connect: the `aenv` CLI (AENV_API_URL) and the RL client's EnvPool.

Its own namespaces and addresses: link 10.91/16, sandbox pools 10.92/16 and 10.93/16.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2b import Sandbox

from agentenv.rl import EnvPool, ExecResult
from agentenv.testing.cluster import Cluster
from agentenv.testing.oci_registry import build_image, write_oci_layout
from agentenv.testing.small_images import tools_layer

CAPACITY = 4  # per node (a base boot-image capture, then a pooled sandbox, hold one)
BURST = 6


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("two-gateways")
    c = Cluster(root, f"g{os.getpid() % 256:02x}", nodes=2, link_net=91, pool_nets=(92, 93),
                max_sandboxes=CAPACITY, schedulers=2, gateways=2, front=True,
                AENV_IMAGE_IMPORT_DIR=str(root / "imports"))
    with c.serving() as serving:
        yield serving


def listed(url: str, key: str) -> list[str]:
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60,
                      trust_env=False) as api:
        r = api.get("/v2/sandboxes", params={"state": "running,paused"})
        r.raise_for_status()
        return sorted(s["sandboxID"] for s in r.json())


def kill_all(sandboxes: list) -> None:
    for sbx in sandboxes:
        if isinstance(sbx, Sandbox):
            sbx.kill()


def test_an_idempotency_key_makes_one_sandbox_through_either_gateway(two: Cluster) -> None:
    first_gw, second_gw = two.gateway_urls()
    made: list[str] = []
    try:
        with two.client(first_gw) as a, two.client(second_gw) as b:
            headers = {"Idempotency-Key": "one-sandbox-" + os.urandom(4).hex()}
            body = {"templateID": "base", "timeout": 60}
            r1 = a.post("/sandboxes", json=body, headers=headers)
            assert r1.status_code == 201, r1.text
            made.append(r1.json()["sandboxID"])
            # The other gateway would place it on the other (emptier) node: the key
            # sends it where the first went, and that node answers with the same one.
            r2 = b.post("/sandboxes", json=body, headers=headers)
            assert r2.status_code == 201, r2.text
            made.append(r2.json()["sandboxID"])
            assert r2.json()["sandboxID"] == r1.json()["sandboxID"]
            # The same key with another request is refused, through either.
            other = b.post("/sandboxes", json={**body, "timeout": 61}, headers=headers)
            assert other.status_code == 422, other.text
            # A key no node takes: a clear 400, and the gateway goes on serving.
            bad = a.post("/sandboxes", json=body, headers={"Idempotency-Key": "k" * 300})
            assert bad.status_code == 400 and "dempotency" in bad.text, bad.text
            assert a.get("/sandboxes").status_code == 200
        assert listed(two.gateway_url, two.api_key) == [made[0]]
    finally:
        with two.client() as api:
            for sid in set(made):
                api.delete(f"/sandboxes/{sid}")


def burst(n: int) -> list[Sandbox | Exception]:
    def one() -> Sandbox | Exception:
        try:  # the key: the SDK's own retry of a 502 makes no second sandbox
            return Sandbox.create(template="base", timeout=120,
                                  idempotency_key=f"burst-{uuid.uuid4().hex}")
        except Exception as exc:  # what the user sees, kept for the assertion
            return exc
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: one(), range(n)))


def test_a_gateway_killed_during_a_burst_fails_no_create(two: Cluster) -> None:
    with ThreadPoolExecutor(1) as pool:
        during = pool.submit(burst, BURST)
        time.sleep(0.5)  # creates under way through both gateways
        two.gateways[0].kill()
        two.gateways[0].wait()
        made = during.result()
    try:
        assert all(isinstance(s, Sandbox) for s in made), made
        ids = sorted(s.sandbox_id for s in made if isinstance(s, Sandbox))
        assert len(set(ids)) == BURST
        # No create made two sandboxes (a retried one is answered with the first).
        assert listed(two.gateway_urls()[1], two.api_key) == ids
        for sbx in made:  # each served through the gateway left, envd traffic too
            assert isinstance(sbx, Sandbox)
            assert sbx.commands.run(f"echo {sbx.sandbox_id}").stdout == f"{sbx.sandbox_id}\n"
    finally:
        kill_all(made)
    assert listed(two.gateway_url, two.api_key) == []


def test_native_clients_use_the_next_gateway_url(two: Cluster) -> None:
    """(After the kill above, the first gateway is dead: it refuses connections.)"""
    dead, alive = two.gateway_urls()
    if two.gateways[0].poll() is None:
        two.gateways[0].kill()
        two.gateways[0].wait()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update(AENV_API_URL=f"{dead},{alive}", AENV_API_KEY=two.api_key, COLUMNS="200")
    cli = [sys.executable, "-m", "agentenv.cli.main"]
    r = subprocess.run([*cli, "ls"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "SANDBOX ID" in r.stdout, r.stdout + r.stderr
    # Bad input: a clear error, no traceback.
    r = subprocess.run([*cli, "ls"], env={**env, "AENV_API_URL": f"{alive},ftp://x"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "invalid URL 'ftp://x'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

    async def rollout() -> ExecResult:
        async with EnvPool([dead, alive], two.api_key, template="base", size=1,
                           run_name="two-gateways") as pool:
            async with pool.env(reset=False) as env_:
                return await env_.exec("echo through the other")
    assert asyncio.run(rollout()) == (0, "through the other\n", "")
    with pytest.raises(ValueError, match="no server URL"):
        EnvPool([], two.api_key, template="base")
    assert listed(alive, two.api_key) == []


def node_of(c: Cluster, sandbox_id: str) -> str:
    with c.client(c.scheduler_url) as sched:
        return sched.get(f"/sandboxes/{sandbox_id}").json()["node"]


def test_a_create_from_an_image_goes_where_the_image_is(two: Cluster) -> None:
    layout = write_oci_layout(two.root / "imports" / "small", build_image([tools_layer()]))
    ref = f"oci-layout:{layout}"
    made: list[str] = []
    try:
        with two.client() as api:
            first = api.post("/sandboxes", json={"image": ref, "timeout": 60})
            assert first.status_code == 201, first.text
            made.append(first.json()["sandboxID"])
            holder = node_of(two, made[0])
            template = first.json()["templateID"]
            api.delete(f"/sandboxes/{made.pop()}")
            # The holder is the busier node now (a sandbox made on it directly), and
            # says in its heartbeat that it holds the image.
            with two.client(two.node(holder).url) as direct:
                busy = direct.post("/sandboxes", json={"templateID": "base", "timeout": 60})
                assert busy.status_code == 201, busy.text
                made.append(busy.json()["sandboxID"])
            end = time.monotonic() + 20
            with two.client(two.scheduler_url) as sched:
                while True:
                    status = sched.get(f"/nodes/{holder}").json()
                    if template in status["templates"] and status["load"] == 1:
                        break
                    assert time.monotonic() < end, status
                    time.sleep(0.2)
        # Through the e2b SDK's way of naming an image: placed on the holder.
        sbx = Sandbox.create(template=f"docker://{ref}", timeout=60)
        made.append(sbx.sandbox_id)
        assert node_of(two, sbx.sandbox_id) == holder
        assert sbx.commands.run("echo from the image").stdout == "from the image\n"
    finally:
        with two.client() as api:
            for sid in made:
                api.delete(f"/sandboxes/{sid}")
