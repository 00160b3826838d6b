"""The build store on its own: records and logs survive a reload; logs are bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.builds import store as builds
from agentenv.builds.steps import expand


def test_records_and_logs_survive_a_reload(tmp_path: Path) -> None:
    store = builds.BuildStore(tmp_path)
    build = builds.Build(build_id="b1", template_id="t1", names=["app"])
    store.put(build)
    store.append("b1", builds.log_entry("hello", step="1"))
    build.status = builds.ERROR
    store.put(build)
    again = builds.BuildStore(tmp_path)
    assert again.get("b1").status == "error" and again.get("b1").names == ["app"]
    assert [e["message"] for e in again.logs("b1")] == ["hello"]
    again.delete("b1")
    assert builds.BuildStore(tmp_path).get("b1") is None
    assert not list(tmp_path.iterdir())


def test_logs_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builds, "MAX_LOG_ENTRIES", 5)
    store = builds.BuildStore(tmp_path)
    for i in range(10):
        store.append("b", builds.log_entry(f"line {i}"))
    store.append("b", builds.log_entry("it failed", "error"))
    store.append("b", builds.log_entry("x" * (builds.MAX_MESSAGE + 10)))
    messages = [e["message"] for e in store.logs("b")]
    assert messages[:5] == [f"line {i}" for i in range(5)]
    assert messages[5] == builds.TRUNCATED and messages[6:] == ["it failed"]
    long = builds.log_entry("y" * (builds.MAX_MESSAGE + 10))["message"]
    assert long.endswith("(10 more characters)")


@pytest.mark.parametrize(("value", "expected"), [
    ("/opt/bin:$PATH", "/opt/bin:/usr/bin"), ("${A}x", "1x"), ("${B:-dflt}", "dflt"),
    ("${A:-dflt}", "1"), ("${A:+alt}", "alt"), ("${B:+alt}", ""), ("\\$A", "$A"),
    ("$A$B.", "1."), ("cost: 5$", "cost: 5$"),
])
def test_env_expansion_like_docker(value: str, expected: str) -> None:
    assert expand(value, {"PATH": "/usr/bin", "A": "1"}) == expected
