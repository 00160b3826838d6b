"""The control plane carries no node: a fresh interpreter that builds the gateway's and
the scheduler's apps, as `aenv gateway` and `aenv scheduler` do, loads none of the
node's code (runtime, network, images, snapshots, the orchestrator) and not pyroute2.
The forbidden contract in pyproject.toml checks the imports one by one; this checks what
a process really loads, the CLI's own imports included."""

from __future__ import annotations

import json
import subprocess
import sys

NODE_ONLY = ("pyroute2", "agentenv.runtime", "agentenv.network", "agentenv.orchestrator",
             "agentenv.images", "agentenv.snapshot", "agentenv.builds", "agentenv.templates",
             "agentenv.api", "agentenv.node")

BUILD_BOTH_APPS = """
import json, sys
from agentenv.cli.main import _cluster_config
from agentenv.cluster.gateway import create_gateway_app
from agentenv.cluster.scheduler import create_scheduler_app

config = _cluster_config(None, "redis://127.0.0.1:1/0")
create_gateway_app(config.redis_url, "http://127.0.0.1:1", "key")
create_scheduler_app(config.redis_url, "key")
print(json.dumps(sorted(sys.modules)))
"""


def test_gateway_and_scheduler_load_nothing_of_the_node() -> None:
    out = subprocess.run([sys.executable, "-c", BUILD_BOTH_APPS], capture_output=True,
                         text=True, check=True, timeout=120)
    loaded = json.loads(out.stdout)
    assert "agentenv.cluster.gateway" in loaded and "fastapi" in loaded
    node_code = [m for m in loaded if m.startswith(NODE_ONLY)]
    assert node_code == [], f"the control plane loaded node code: {node_code[:20]}"
