"""What an RL trainer does to a node, for real: bursts beyond capacity queue instead of
failing, retried creates with an Idempotency-Key make one sandbox, runs own their
sandboxes (DELETE, a lapsed lease, a trainer killed with -9), and every sandbox says
when it was queued, placed, booted and ready. A node of its own: capacity 4."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing import Node, free_cidr, serving

CLI = [sys.executable, "-m", "agentenv.cli.main"]
CAPACITY = 4


@pytest.fixture(scope="module")
def rl_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    prefix = f"r{os.getpid() % 4096:03x}"
    with serving(Node(tmp_path_factory.mktemp("rl") / "home", prefix,
                      free_cidr(150, 10, os.getpid()), AENV_MAX_SANDBOXES=str(CAPACITY))) as node:
        yield node


@pytest.fixture
def api(rl_node: Node) -> Iterator[httpx.Client]:
    with rl_node.client() as client:
        yield client


def _ids(api: httpx.Client) -> set[str]:
    return {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}


def test_a_burst_beyond_capacity_queues_and_all_succeed(api: httpx.Client) -> None:
    def rollout(i: int) -> str:
        sbx = Sandbox.create(template="base", timeout=120)
        try:
            return sbx.commands.run(f"echo {i}").stdout.strip()
        finally:
            sbx.kill()

    with ThreadPoolExecutor(10) as pool:
        out = list(pool.map(rollout, range(10)))
    assert out == [str(i) for i in range(10)]  # 10 creates on 4 places, none refused
    assert _ids(api) == set()


def test_a_client_hanging_up_while_queued_leaves_nothing(api: httpx.Client) -> None:
    full = [api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            for _ in range(CAPACITY)]
    with pytest.raises(httpx.ReadTimeout):
        api.post("/sandboxes", json={"templateID": "base"}, timeout=1.0)
    time.sleep(1.5)  # the node notices the hang-up while the create waits
    for sid in full:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
    time.sleep(1.0)  # a create still queued would be admitted now
    assert _ids(api) == set()


def test_timings_are_in_the_record_the_listing_and_aenv_ls(rl_node: Node,
                                                           api: httpx.Client) -> None:
    sbx = Sandbox.create(template="base", timeout=120)
    try:
        got = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        stamps = [got[k] for k in ("queuedAt", "placedAt", "bootedAt", "readyAt")]
        assert all(stamps) and stamps == sorted(stamps) and got["placedAt"] == got["startedAt"]
        # The SDK reads the record as before (unknown fields are kept aside).
        assert Sandbox.get_info(sbx.sandbox_id).sandbox_id == sbx.sandbox_id
        env = {**os.environ, "AENV_API_URL": rl_node.url, "AENV_API_KEY": rl_node.api_key}
        out = subprocess.run([*CLI, "ls", "--json"], env=env, capture_output=True, text=True,
                             timeout=60, check=True).stdout
        (listed,) = [s for s in json.loads(out) if s["sandboxID"] == sbx.sandbox_id]
        assert listed["readyAt"] == got["readyAt"] and listed["queuedAt"] == got["queuedAt"]
    finally:
        sbx.kill()


def test_an_idempotent_create_makes_one_sandbox(api: httpx.Client) -> None:
    body = {"templateID": "base", "timeout": 120}
    first = api.post("/sandboxes", json=body, headers={"Idempotency-Key": "retry-1"})
    assert first.status_code == 201, first.text
    again = api.post("/sandboxes", json=body, headers={"Idempotency-Key": "retry-1"})
    assert again.status_code == 201 and again.json() == first.json()
    other = api.post("/sandboxes", json={**body, "timeout": 60},
                     headers={"Idempotency-Key": "retry-1"})
    assert other.status_code == 422 and "different request" in other.json()["message"]
    # Duplicates sent at once wait for the first and get its answer.
    with ThreadPoolExecutor(4) as pool:
        same = list(pool.map(lambda _: api.post("/sandboxes", json=body,
                                                headers={"Idempotency-Key": "burst-2"}),
                             range(4)))
    assert {r.status_code for r in same} == {201}
    assert len({r.json()["sandboxID"] for r in same}) == 1
    # The e2b SDK's own idempotency_key (as its retries send it) gets the same.
    sdk = [Sandbox.create(template="base", timeout=120, idempotency_key="sdk-3")
           for _ in range(2)]
    assert sdk[0].sandbox_id == sdk[1].sandbox_id
    made = {first.json()["sandboxID"], same[0].json()["sandboxID"], sdk[0].sandbox_id}
    assert _ids(api) == made
    for bad in ("k" * 256, b"caf\xe9"):
        r = api.post("/sandboxes", json=body, headers={"Idempotency-Key": bad})
        assert r.status_code == 400 and "Idempotency-Key" in r.json()["message"]
    assert _ids(api) == made
    for sid in made:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204


def test_hostile_run_inputs_are_clear_400s(api: httpx.Client) -> None:
    for body in ({"name": "bad name"}, {"name": "x" * 65}, {},
                 {"name": "ok", "leaseSeconds": 10**9}, {"name": "ok", "leaseSeconds": "300"},
                 {"name": "ok", "leaseSeconds": 4}, {"name": "ok", "onExpiry": "explode"},
                 {"name": ["ok"]}):
        r = api.post("/runs", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["code"] == 400 and r.json()["message"]
    for headers, meta in (({"X-Aenv-Run": "run_nosuchrun"}, {}),
                          ({}, {"aenv.run": "../../etc"})):
        r = api.post("/sandboxes", json={"templateID": "base", "metadata": meta},
                     headers=headers)
        assert r.status_code == 400 and "unknown or has ended" in r.json()["message"]
    assert api.get("/runs/run_nosuchrun").status_code == 404
    assert api.post("/runs/run_nosuchrun/heartbeat").status_code == 404
    assert api.delete("/runs/run_nosuchrun").status_code == 404
    assert _ids(api) == set() and api.get("/runs").json() == []


def test_delete_run_kills_or_pauses_its_sandboxes(rl_node: Node, api: httpx.Client) -> None:
    run = api.post("/runs", json={"name": "trainer.a", "leaseSeconds": 600}).json()
    assert run["leaseSeconds"] == 600 and run["onExpiry"] == "kill" and run["sandboxes"] == 0
    outside = Sandbox.create(template="base", timeout=120)
    members = [Sandbox.create(template="base", timeout=120,
                              metadata={"aenv.run": run["runID"]}).sandbox_id,
               api.post("/sandboxes", json={"templateID": "base"},
                        headers={"X-Aenv-Run": run["runID"]}).json()["sandboxID"]]
    assert api.get(f"/runs/{run['runID']}").json()["sandboxes"] == 2
    assert api.get(f"/sandboxes/{members[1]}").json()["runID"] == run["runID"]
    env = {**os.environ, "AENV_API_URL": rl_node.url, "AENV_API_KEY": rl_node.api_key}
    listed = json.loads(subprocess.run([*CLI, "run", "ls", "--json"], env=env, check=True,
                                       capture_output=True, text=True, timeout=60).stdout)
    assert [r["runID"] for r in listed] == [run["runID"]]
    subprocess.run([*CLI, "run", "rm", run["runID"]], env=env, check=True,
                   capture_output=True, timeout=60)
    assert api.get(f"/runs/{run['runID']}").status_code == 404
    assert _ids(api) == {outside.sandbox_id}
    # A run that asked for pauses leaves its sandboxes paused.
    paused = api.post("/runs", json={"name": "p", "onExpiry": "pause"}).json()
    sid = api.post("/sandboxes", json={"templateID": "base"},
                   headers={"X-Aenv-Run": paused["runID"]}).json()["sandboxID"]
    assert api.delete(f"/runs/{paused['runID']}").status_code == 204
    states = {s["sandboxID"]: s["state"] for s in
              api.get("/v2/sandboxes", params={"state": ["running", "paused"]}).json()}
    assert states == {outside.sandbox_id: "running", sid: "paused"}
    for gone in (sid, outside.sandbox_id):
        assert api.delete(f"/sandboxes/{gone}").status_code == 204


TRAINER = textwrap.dedent("""
    import os, threading, time
    import httpx
    from e2b import Sandbox
    url, headers = os.environ["E2B_API_URL"], {"X-API-Key": os.environ["E2B_API_KEY"]}
    run = httpx.post(url + "/runs", json={"name": "trainer", "leaseSeconds": 5},
                     headers=headers).json()["runID"]
    def beat():
        while True:
            time.sleep(1)
            httpx.post(f"{url}/runs/{run}/heartbeat", headers=headers)
    threading.Thread(target=beat, daemon=True).start()
    ids = [Sandbox.create(template="base", metadata={"aenv.run": run}).sandbox_id
           for _ in range(3)]
    print(run, *ids, flush=True)
    time.sleep(3600)
""")


def test_a_trainer_killed_with_9_leaks_nothing_after_its_lease(rl_node: Node,
                                                                api: httpx.Client,
                                                                tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **rl_node.e2b_env()}, start_new_session=True)
    try:
        assert proc.stdout is not None
        run, *ids = proc.stdout.readline().split()
        assert len(ids) == 3 and _ids(api) == set(ids)
        before = api.get(f"/runs/{run}").json()["expiresAt"]
        time.sleep(1.5)
        assert api.get(f"/runs/{run}").json()["expiresAt"] > before  # the heartbeat renews
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    end = time.monotonic() + 30
    while (_ids(api) or api.get(f"/runs/{run}").status_code != 404) and \
            time.monotonic() < end:
        time.sleep(0.5)
    assert _ids(api) == set() and api.get(f"/runs/{run}").status_code == 404
    assert httpx.get(rl_node.url + "/health").status_code == 200
