"""Failover of the control plane at small size: two gateways, two schedulers, and Redis
as a primary, a replica and Sentinel, over ten simulated nodes
(agentenv.testing.sim_nodes) heartbeating to both schedulers, with creates flowing
through both gateways, each under an Idempotency-Key of its own, retried by the
client under the same key through the other gateway when its gateway fails it (as
the native clients and the front do):

- a gateway killed with -9, then a scheduler, then the Redis primary: each key's
  node is on the replica before its create is sent (``WAIT``); every create
  is answered 201 in the end, no create is lost (every key's sandbox is held by a
  node, and listed) and none is doubled (one sandbox per key across the nodes);
- after each kill, service recovers: creates succeed again, through the gateway
  left, and the nodes stay up (their heartbeats go to the scheduler left, Redis
  commands through Sentinel's new primary).
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from agentenv.testing.cluster import Cluster
from agentenv.testing.sim_cluster import InThread, sim_fixtures, up_nodes, wait_for
from agentenv.testing.sim_records import Behaviour

NODES = 10
HEARTBEAT_S = 0.3
NODE_TTL_MS = 3000
# Creates at once, and how long a create may take through its retries.
FLOW = 6
CREATE_DEADLINE_S = 60.0


# A create takes 50 ms on the node: some are on their way at each kill.
cluster, sim = sim_fixtures("sim-failover", "f", NODES,
                            Behaviour(capacity=100, heartbeat_s=HEARTBEAT_S, create_s=0.05),
                            wait=30, node_ttl_ms=NODE_TTL_MS, gateway_queue_s=5.0,
                            schedulers=2, gateways=2, sentinel=True)


class Flow:
    """Creates under keys of their own, ``FLOW`` at once, through the gateways in turn
    until stopped; a create a gateway fails (no answer, 5xx) is sent again under its
    key through the other gateway. ``made``: key -> the sandbox its 201 named."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.urls = cluster.gateway_urls()
        self.made: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.retried = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(FLOW)
        self._futures = [self._pool.submit(self._worker, i) for i in range(FLOW)]

    def _create(self, key: str, first: int) -> None:
        end = time.monotonic() + CREATE_DEADLINE_S
        i, last = first, ""
        while time.monotonic() < end:
            url = self.urls[i % len(self.urls)]
            try:
                with httpx.Client(base_url=url, timeout=30, trust_env=False,
                                  headers={"X-API-Key": self.cluster.api_key,
                                           "Idempotency-Key": key}) as api:
                    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 600})
                if r.status_code == 201:
                    with self._lock:
                        self.made[key] = r.json()["sandboxID"]
                    return
                last = f"{r.status_code} {r.text[:200]}"
                if r.status_code < 500 and r.status_code != 429:
                    break  # an answer a retry would not change
            except httpx.HTTPError as exc:
                last = repr(exc)
            with self._lock:
                self.retried += 1
            i += 1  # the other gateway
            time.sleep(0.1)
        with self._lock:
            self.failed[key] = last

    def _worker(self, w: int) -> None:
        n = 0
        while not self._stop.is_set():
            self._create(f"flow-{w}-{n}-{uuid.uuid4().hex[:8]}", w + n)
            n += 1

    def count(self) -> int:
        with self._lock:
            return len(self.made) + len(self.failed)

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result()
        self._pool.shutdown()


def made_since(flow: Flow, before: int, n: int, what: str) -> None:
    wait_for(lambda: flow.count() >= before + n, f"{n} creates {what}", CREATE_DEADLINE_S)


def test_kills_lose_and_double_no_create(cluster: Cluster, sim: InThread) -> None:
    flow = Flow(cluster)
    try:
        made_since(flow, 0, 20, "before any kill")

        cluster.gateways[0].kill()  # -9, creates on their way through it
        cluster.gateways[0].wait()
        made_since(flow, flow.count(), 20, "after the gateway's kill")

        cluster.schedulers[0].kill()
        cluster.schedulers[0].wait()
        made_since(flow, flow.count(), 20, "after the scheduler's kill")

        assert cluster.redis_primary() == cluster.redis_port
        assert cluster.redis is not None
        # Each key's node was on the replica before its create was sent (WAIT).
        with redis.Redis(port=cluster.redis_port) as primary:
            waits = primary.info("commandstats").get("cmdstat_wait", {}).get("calls", 0)
        assert waits >= len(flow.made) > 0, (waits, len(flow.made))
        cluster.redis.kill()
        cluster.redis.wait()
        wait_for(lambda: cluster.redis_primary() == cluster.replica_port,
                 "Sentinel promoted the replica", 30)
        made_since(flow, flow.count(), 20, "after the Redis primary's kill")
    finally:
        flow.stop()

    assert not flow.failed, flow.failed
    assert flow.retried > 0  # the kills failed some tries, which went again
    # None doubled: one sandbox per key, and the nodes hold no other.
    held = {sid: node for node, sandboxes in sim.states().items() for sid in sandboxes}
    assert len(set(flow.made.values())) == len(flow.made)
    assert sorted(held) == sorted(flow.made.values()), (
        f"{len(held)} held for {len(flow.made)} keys")
    # None lost: the gateway left lists every one, every node up again.
    wait_for(lambda: len(up_nodes(cluster)) == NODES, "every node up after the kills", 30)
    survivor = cluster.gateway_urls()[1]
    with cluster.client(survivor) as api:
        listed = {i["sandboxID"] for i in api.get("/sandboxes").json()}
        assert listed == set(flow.made.values())
        for sid in flow.made.values():
            assert api.delete(f"/sandboxes/{sid}").status_code == 204, sid
    assert sim.states() == {n.node_id: {} for n in sim.sim.nodes}
