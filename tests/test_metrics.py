"""Prometheus metrics: /metrics behind the key (X-API-Key or Bearer), and the figures
move as a user drives the node through the e2b SDK."""

from __future__ import annotations

import httpx
from e2b import Sandbox
from prometheus_client.parser import text_string_to_metric_families

from agentenv.testing import Node


def scrape(node: Node) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(node.url + "/metrics", headers={"Authorization": f"Bearer {node.api_key}"},
                  timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def count(samples: dict, operation: str) -> float:
    return value(samples, "aenv_lifecycle_seconds_count", operation=operation, outcome="ok")


def test_metrics_need_the_key(node: Node) -> None:
    assert httpx.get(node.url + "/metrics", timeout=10).status_code == 401
    bad = httpx.get(node.url + "/metrics", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert bad.status_code == 401
    ok = httpx.get(node.url + "/metrics", headers={"X-API-Key": node.api_key}, timeout=10)
    assert ok.status_code == 200 and "aenv_sandboxes" in ok.text


def test_metrics_move_as_the_node_works(node: Node, api: httpx.Client) -> None:
    before = scrape(node)
    assert value(before, "aenv_host_memory_bytes", kind="total") > 0
    assert value(before, "aenv_host_cpus") >= 1

    sbx = Sandbox.create("base", timeout=120)
    try:
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        during = scrape(node)
        assert value(during, "aenv_sandboxes", state="running") >= 1
        snap = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots")
        assert snap.status_code == 201, snap.text
        fork = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
        assert fork.status_code == 201 and "sandbox" in fork.json()[0], fork.text
        api.delete(f"/sandboxes/{fork.json()[0]['sandbox']['sandboxID']}")
        sbx.pause()
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run("echo back").stdout == "back\n"
    finally:
        sbx.kill()
    assert api.post("/sandboxes", json={"templateID": "no-such-template"}).status_code == 404

    after = scrape(node)
    for operation in ("create", "snapshot", "fork", "pause", "resume", "delete"):
        assert count(after, operation) >= count(before, operation) + 1, operation
    assert value(after, "aenv_lifecycle_seconds_count", operation="create", outcome="error") \
        >= value(before, "aenv_lifecycle_seconds_count", operation="create", outcome="error") + 1
    assert value(after, "aenv_first_command_seconds_count") >= \
        value(before, "aenv_first_command_seconds_count") + 1
    captured = value(after, "aenv_snapshot_bytes_total", kind="captured") - \
        value(before, "aenv_snapshot_bytes_total", kind="captured")
    stored = value(after, "aenv_snapshot_bytes_total", kind="stored") - \
        value(before, "aenv_snapshot_bytes_total", kind="stored")
    assert captured > 1 << 20 and 0 <= stored <= captured
    assert value(after, "aenv_http_requests_total", method="POST", code="404") >= \
        value(before, "aenv_http_requests_total", method="POST", code="404") + 1
    assert value(after, "aenv_sandboxes", state="paused") >= 0  # every state is reported


def test_the_grafana_dashboard_uses_only_metrics_that_exist(node: Node) -> None:
    import json
    import re
    from pathlib import Path

    dashboard = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / \
        "agentenv-dashboard.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"]
             for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\baenv_[a-z0-9_]+", e)}
    exported = set()
    for family in text_string_to_metric_families(httpx.get(
            node.url + "/metrics", headers={"X-API-Key": node.api_key}, timeout=10).text):
        # A labelled series with no sample yet is announced by its family's name.
        exported |= {s.name for s in family.samples} | {
            family.name + suffix for suffix in ("", "_total", "_count", "_sum", "_bucket")}
    # The cluster's own series come from the scheduler (tests/test_cluster.py scrapes it).
    cluster = {"aenv_cluster_nodes", "aenv_cluster_sandboxes", "aenv_cluster_capacity",
               "aenv_placements_total"}
    assert used - exported - cluster == set()
