"""An evaluation harness's E2B flow, through the e2b SDK (issue 33, item 2).

As harnesses drive E2B: a template built from a task's Dockerfile with no USER line
(FROM the base template, a WORKDIR), a sandbox from it, the solution and the test
script uploaded as the default user, both run as root, logs and artifacts (files
root wrote among them) downloaded, the sandbox killed. Then the separate-verifier
variant: a second sandbox gets the first one's artifacts and runs the tests.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from e2b import Sandbox, Template

from agentenv.testing import Node

# A task's Dockerfile as harnesses ship them: FROM (here the base template), a
# WORKDIR, no USER line.
DOCKERFILE = "FROM base\nWORKDIR /app\nRUN echo task > /app/TASK\n"
SOLVE = "#!/bin/sh\nset -e\nmkdir -p /app/out\necho 42 > /app/out/answer.txt\necho solved\n"
TEST = ("#!/bin/sh\nmkdir -p /logs/verifier\n"
        "if [ \"$(cat /app/out/answer.txt)\" = 42 ]; then r=1; else r=0; fi\n"
        "echo $r > /logs/verifier/reward.txt\nchmod 600 /logs/verifier/reward.txt\n"
        "echo tested > /logs/verifier/test.log\n")


@pytest.fixture(scope="module")
def task_template(node: Node):
    name = f"harness-{uuid.uuid4().hex[:8]}"
    Template.build(Template().from_dockerfile(DOCKERFILE), name)
    yield name
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key}) as api:
        api.delete(f"/templates/{name}")


def _run_as_root(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd, user="root", timeout=60).stdout


def test_harness_uploads_runs_as_root_downloads_and_kills(task_template: str) -> None:
    sbx = Sandbox.create(task_template, timeout=300)
    try:
        assert sbx.commands.run("pwd; cat TASK").stdout == "/app\ntask\n"
        sbx.files.write("/solution/solve.sh", SOLVE)  # the default user, no USER line
        sbx.files.write("/tests/test.sh", TEST)
        assert _run_as_root(sbx, "mkdir -p /logs && sh /solution/solve.sh > /logs/agent.log"
                                 " 2>&1; cat /logs/agent.log") == "solved\n"
        _run_as_root(sbx, "sh /tests/test.sh")
        # root's files come back, 0600 or not, and the user may write over them
        assert sbx.files.read("/logs/verifier/reward.txt") == "1\n"
        assert sbx.files.read("/logs/agent.log") == "solved\n"
        assert [e.name for e in sbx.files.list("/logs/verifier")] == ["reward.txt", "test.log"]
        sbx.files.write("/logs/agent.log", "rotated\n")
        assert sbx.files.read("/logs/agent.log") == "rotated\n"
        assert sbx.files.read("/app/out/answer.txt", format="bytes") == b"42\n"
    finally:
        sbx.kill()
    assert not sbx.is_running()


def test_separate_verifier_gets_the_artifacts(task_template: str) -> None:
    agent = Sandbox.create(task_template, timeout=300)
    verifier = Sandbox.create(task_template, timeout=300)
    try:
        agent.files.write("/solution/solve.sh", SOLVE)
        _run_as_root(agent, "sh /solution/solve.sh")
        # the artifacts move from the agent's sandbox to the verifier's
        verifier.files.write_files([
            {"path": "/app/out/answer.txt", "data": bytes(agent.files.read(
                "/app/out/answer.txt", format="bytes"))},
            {"path": "/tests/test.sh", "data": TEST},
        ])
        agent.kill()
        _run_as_root(verifier, "sh /tests/test.sh")
        assert verifier.files.read("/logs/verifier/reward.txt") == "1\n"
        assert verifier.files.read("/logs/verifier/test.log") == "tested\n"
    finally:
        agent.kill()
        verifier.kill()
