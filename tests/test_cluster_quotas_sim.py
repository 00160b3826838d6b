"""A key's quota of running sandboxes holds across the cluster: two gateways
(``key_max_sandboxes = 5``, counted in Redis) over ten simulated nodes with room for
forty (agentenv.testing.sim_nodes):

- a burst through both gateways at once makes five sandboxes, the rest 429 with
  Retry-After; a kill or a pause through either gateway is room again, a resume of
  a paused sandbox is refused at quota;
- a sandbox that ends on its node by itself (not through a gateway) is room again
  once its node's heartbeat no longer lists it;
- a create retried under its Idempotency-Key at quota gets its sandbox, not a 429;
- a fork's children count: at quota a fork is refused (429), and a fork of more
  children than there is room for makes none.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from agentenv.testing.cluster import Cluster
from agentenv.testing.sim_cluster import InThread, sim_fixtures, wait_for
from agentenv.testing.sim_records import Behaviour

NODES = 10
QUOTA = 5
HEARTBEAT_S = 0.3


# The gateways' config, from their env.
cluster, sim = sim_fixtures("sim-quotas", "q", NODES,
                            Behaviour(capacity=4, heartbeat_s=HEARTBEAT_S),
                            env={"AENV_KEY_MAX_SANDBOXES": str(QUOTA)},
                            node_ttl_ms=3000, gateway_queue_s=1.0, gateways=2)


def running_ids(sim: InThread) -> set[str]:
    return {sid for sandboxes in sim.states().values()
            for sid, state in sandboxes.items() if state == "running"}


def create(cluster: Cluster, i: int, key: str = "") -> httpx.Response:
    with cluster.client(cluster.gateway_urls()[i % 2]) as api:
        return api.post("/sandboxes", json={"templateID": "base"},
                        headers={"Idempotency-Key": key} if key else {})


def test_a_keys_quota_holds_across_gateways_and_nodes(cluster: Cluster,
                                                      sim: InThread) -> None:
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda i: create(cluster, i), range(12)))
    made = [r.json()["sandboxID"] for r in answers if r.status_code == 201]
    refused = [r for r in answers if r.status_code != 201]
    assert len(made) == QUOTA, [r.status_code for r in answers]
    assert all(r.status_code == 429 and r.headers["retry-after"] for r in refused)
    assert "quota" in refused[0].json()["message"]
    assert running_ids(sim) == set(made)
    assert len({node for node, s in sim.states().items() if s}) > 1  # across nodes

    a, b = (cluster.client(url) for url in cluster.gateway_urls())
    with a, b:
        # A kill through one gateway is room through the other.
        assert b.delete(f"/sandboxes/{made[0]}").status_code == 204
        r = create(cluster, 0)
        assert r.status_code == 201, r.text
        made[0] = r.json()["sandboxID"]
        assert create(cluster, 1).status_code == 429
        # A paused sandbox holds none of the quota; resuming it at quota is refused.
        assert a.post(f"/sandboxes/{made[1]}/pause").status_code == 204
        r = create(cluster, 1)
        assert r.status_code == 201, r.text
        paused, made[1] = made[1], r.json()["sandboxID"]
        assert b.post(f"/sandboxes/{paused}/resume").status_code == 429
        assert b.delete(f"/sandboxes/{paused}").status_code == 204

        # One that ends on its node by itself is room once a heartbeat says so.
        node = next(n for n, s in sim.states().items() if made[2] in s)
        with cluster.client(sim.sim.node(node).url) as direct:
            assert direct.delete(f"/sandboxes/{made[2]}").status_code == 204

        def replaced() -> bool:
            r = create(cluster, 0)
            assert r.status_code in (201, 429), r.text
            if r.status_code == 201:
                made[2] = r.json()["sandboxID"]
            return r.status_code == 201

        wait_for(replaced, "room again after the node's heartbeat")
        assert running_ids(sim) == set(made)

        # A create retried under its key at quota gets its sandbox.
        assert b.delete(f"/sandboxes/{made[3]}").status_code == 204
        first = create(cluster, 0, key="quota-key-1")
        assert first.status_code == 201, first.text
        again = create(cluster, 1, key="quota-key-1")
        assert again.status_code == 201, again.text
        assert again.json()["sandboxID"] == first.json()["sandboxID"]
        made[3] = first.json()["sandboxID"]
        assert running_ids(sim) == set(made)

        # A fork's children count too: at quota a fork is refused, and one of more
        # children than there is room for makes none of them.
        r = a.post(f"/sandboxes/{made[0]}/fork", json={"count": 1})
        assert r.status_code == 429 and "quota" in r.json()["message"], r.text
        for sid in made[3:]:
            assert a.delete(f"/sandboxes/{sid}").status_code == 204
        del made[3:]
        r = b.post(f"/sandboxes/{made[0]}/fork", json={"count": 3})
        assert r.status_code == 429 and "3 at once" in r.json()["message"], r.text
        assert running_ids(sim) == set(made)
        r = b.post(f"/sandboxes/{made[0]}/fork", json={"count": 2})
        assert r.status_code == 201, r.text
        made += [c["sandbox"]["sandboxID"] for c in r.json()]
        assert len(made) == QUOTA and running_ids(sim) == set(made)
        assert create(cluster, 0).status_code == 429

        for sid in made:
            assert a.delete(f"/sandboxes/{sid}").status_code == 204
    assert running_ids(sim) == set()
