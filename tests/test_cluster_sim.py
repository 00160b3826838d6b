"""The real control plane (redis-server, `aenv scheduler`, `aenv gateway`, started as
tests/test_cluster.py starts them) over ten simulated nodes (agentenv.testing.sim_nodes:
the cluster protocol, no sandboxes):

- creates through the gateway are placed across the nodes, none over its capacity,
  each on the node Redis names as its owner;
- listing through the gateway merges every node, page by page, newest first;
- a node whose heartbeats lapse is marked down and gets no more creates; its running
  sandbox is 410 (lost), its committed paused one is listed as paused and taken over
  by another node on resume, a kill of the lost one is still sent to the node (it may
  only be slow), and when it heartbeats again it is told to drop what was taken over.
"""

from __future__ import annotations

import base64
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import pytest

from agentenv.testing.cluster import Cluster
from agentenv.testing.sim_cluster import InThread, sim_fixtures, up_nodes, wait_for
from agentenv.testing.sim_records import Behaviour

NODES = 10
CAPACITY = 4
HEARTBEAT_S = 0.3
# Ten heartbeats: a loaded machine delays some, and a node falsely down would fail
# the listings asserted here.
NODE_TTL_MS = 3000


cluster, sim = sim_fixtures("sim-cluster", "s", NODES,
                            Behaviour(capacity=CAPACITY, heartbeat_s=HEARTBEAT_S),
                            node_ttl_ms=NODE_TTL_MS, gateway_queue_s=2.0)


@pytest.fixture
def api(cluster: Cluster) -> Iterator[httpx.Client]:
    with cluster.client() as client:
        yield client


def where(sim: InThread) -> dict[str, str]:
    """Sandbox ID -> the simulated node holding it."""
    return {sid: node for node, sandboxes in sim.states().items() for sid in sandboxes}


def create(api: httpx.Client, n: int) -> list[str]:
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: api.post("/sandboxes", json={"templateID": "base"}),
                                range(n)))
    assert [r.status_code for r in answers] == [201] * n, [r.text for r in answers][:3]
    return [r.json()["sandboxID"] for r in answers]


def test_creates_are_placed_across_nodes_and_listed(cluster: Cluster, sim: InThread,
                                                    api: httpx.Client) -> None:
    asked = sim.sim.requests["list"]
    ids = create(api, 2 * NODES)
    # Listed at once (the creates' answers indexed them, no heartbeat waited for).
    assert {i["sandboxID"] for i in api.get("/v2/sandboxes").json()} == set(ids)
    held = where(sim)
    per_node = Counter(held[sid] for sid in ids)
    # Least loaded first: twenty creates on ten idle nodes of four fill none.
    assert len(per_node) >= NODES // 2 and max(per_node.values()) <= CAPACITY, per_node
    assert all(cluster.owner(sid) == held[sid] for sid in ids)

    seen: list[dict] = []
    token = None
    while True:
        r = api.get("/v2/sandboxes", params={"limit": 7, **({"nextToken": token} if token
                                                             else {})})
        assert r.status_code == 200, r.text
        seen += r.json()
        token = r.headers.get("x-next-token")
        if not token:
            break
    assert sorted(i["sandboxID"] for i in seen) == sorted(ids)
    started = [(datetime.fromisoformat(i["startedAt"].replace("Z", "+00:00")), i["sandboxID"])
               for i in seen]
    assert started == sorted(started, reverse=True)  # newest first across nodes
    assert {i["sandboxID"] for i in api.get("/sandboxes").json()} == set(ids)
    listing_is_bounded(api, ids, seen)
    assert sim.sim.requests["list"] == asked  # from Redis: no node was asked

    for sid in ids:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert where(sim) == {} and api.get("/v2/sandboxes").json() == []


def listing_is_bounded(api: httpx.Client, ids: list[str], seen: list[dict]) -> None:
    """E2B's paging and filters, and what hostile ones get."""
    # Oldest first, page by page: the same sandboxes in the other order.
    asc, token = [], None
    while True:
        r = api.get("/v2/sandboxes", params={"order": "asc", "limit": 3,
                                             **({"nextToken": token} if token else {})})
        asc += [i["sandboxID"] for i in r.json()]
        token = r.headers.get("x-next-token")
        if not token:
            break
    assert asc == [i["sandboxID"] for i in reversed(seen)]
    # limit is clamped to 1..100, as E2B's API does; not a number is a 400.
    assert len(api.get("/v2/sandboxes", params={"limit": 0}).json()) == 1
    assert len(api.get("/v2/sandboxes", params={"limit": 10 ** 9}).json()) == len(ids)
    for bad in ("x", "9" * 40):
        r = api.get("/v2/sandboxes", params={"limit": bad})
        assert r.status_code == 400 and "limit" in r.json()["message"], r.text
    # A garbled or forged token is a clear 400; one of the other order too.
    first = api.get("/v2/sandboxes", params={"limit": 1})
    forged = base64.urlsafe_b64encode(b"yesterday__../../etc").decode()
    for bad in ("%%%", "not-base64!", forged, "A" * 5000):
        r = api.get("/v2/sandboxes", params={"nextToken": bad})
        assert r.status_code == 400 and "nextToken" in r.json()["message"], (bad, r.text)
    r = api.get("/v2/sandboxes", params={"order": "asc",
                                         "nextToken": first.headers["x-next-token"]})
    assert r.status_code == 400 and "order" in r.json()["message"]
    # Metadata, state and time filters; bounded.
    tagged = [api.post("/sandboxes", json={"templateID": "base", "metadata": {"job": "a"}})
              .json()["sandboxID"] for _ in range(2)]
    by_job = api.get("/v2/sandboxes", params={"metadata": "job=a", "limit": 1})
    page2 = api.get("/v2/sandboxes", params={"metadata": "job=a",
                                             "nextToken": by_job.headers["x-next-token"]})
    assert sorted(i["sandboxID"] for i in by_job.json() + page2.json()) == sorted(tagged)
    assert api.get("/v2/sandboxes", params={"metadata": "job=a&x=y"}).json() == []
    for sid in tagged:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert api.get("/v2/sandboxes", params={"metadata": "job=a"}).json() == []
    r = api.get("/v2/sandboxes", params={"state": "paused"})
    assert r.status_code == 200 and r.json() == []

    def at(i: dict) -> datetime:
        return datetime.fromisoformat(i["startedAt"].replace("Z", "+00:00"))

    middle = seen[len(seen) // 2]
    later = api.get("/v2/sandboxes", params={"startedAfter": middle["startedAt"]}).json()
    assert 0 < len(later) < len(ids) and all(at(i) >= at(middle) for i in later)
    many = "&".join(f"k{n}=v" for n in range(17))
    for params in ({"metadata": many}, {"metadata": "k=" + "v" * 5000},
                   {"startedAfter": "soon"}, {"state": "gone"}, {"order": "sideways"}):
        r = api.get("/v2/sandboxes", params=params)
        assert r.status_code == 400, (params, r.text)


def test_a_node_whose_heartbeats_lapse(cluster: Cluster, sim: InThread,
                                       api: httpx.Client) -> None:
    ids = create(api, NODES)
    held = where(sim)
    lapsing = held[ids[0]]
    on_it = [sid for sid in ids if held[sid] == lapsing]
    if len(on_it) < 2:  # a second sandbox on that node, made there directly
        with cluster.client(sim.sim.node(lapsing).url) as direct:
            r = direct.post("/sandboxes", json={"templateID": "base"})
            assert r.status_code == 201, r.text
            on_it.append(r.json()["sandboxID"])
            ids.append(on_it[-1])
    running_one, paused_one = on_it[0], on_it[1]
    assert api.post(f"/sandboxes/{paused_one}/pause").status_code == 204
    sim.beat(lapsing)  # Redis has its pause snapshot, committed: it can be taken over

    sim.set_heartbeating(lapsing, False)
    wait_for(lambda: lapsing not in up_nodes(cluster), f"{lapsing} marked down", 10)

    # No create goes to a down node.
    more = create(api, 6)
    assert lapsing not in {where(sim)[sid] for sid in more}
    ids += more

    # Its running sandbox is lost (no snapshot to resume from); listed only when asked.
    r = api.get(f"/sandboxes/{running_one}")
    assert r.status_code == 410 and lapsing in r.json()["message"], r.text
    listed = {i["sandboxID"]: i for i in api.get("/v2/sandboxes").json()}
    assert running_one not in listed
    assert listed[paused_one]["state"] == "paused"
    assert listed[paused_one]["lost"]["nodeID"] == lapsing
    lost = api.get("/v2/sandboxes", params={"state": "lost"}).json()
    assert sorted(i["sandboxID"] for i in lost) == sorted(set(on_it) - {paused_one})

    # Its committed paused one is taken over by another node when resumed.
    r = api.post(f"/sandboxes/{paused_one}/resume")
    assert r.status_code == 201, r.text
    taker = cluster.owner(paused_one)
    assert taker != lapsing and sim.states()[taker][paused_one] == "running"

    # A kill of the lost one still reaches its node, which may only be slow.
    assert api.delete(f"/sandboxes/{running_one}").status_code == 204
    assert running_one not in sim.states()[lapsing]
    ids.remove(running_one)

    # Back: its next heartbeat is told to drop the sandbox another node took over.
    assert paused_one in sim.states()[lapsing]
    sim.set_heartbeating(lapsing, True)
    wait_for(lambda: lapsing in up_nodes(cluster), f"{lapsing} up again")
    wait_for(lambda: paused_one not in sim.states()[lapsing], "the taken-over copy dropped")
    assert cluster.owner(paused_one) == taker

    for sid in ids:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204, sid
    assert where(sim) == {}
