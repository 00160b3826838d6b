"""The `aenv` CLI, driven as a subprocess against the session's real node."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agentenv.testing import Node
from agentenv.testing.nodes import AENV

CLI = [sys.executable, "-m", "agentenv.cli.main"]


@pytest.fixture(scope="module")
def cli_env(node: Node, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AENV_", "E2B_", "XDG_CONFIG_HOME"))}
    env.update(AENV_CONFIG_DIR=str(tmp_path_factory.mktemp("aenv-config")),
               AENV_API_URL=node.url, AENV_API_KEY=node.api_key, COLUMNS="200")
    return env


def aenv(env: dict[str, str], *args: str, check: bool = True, timeout: float = 120,
         **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True,
                       timeout=timeout, start_new_session=True, **kw)
    if check:
        assert r.returncode == 0, f"aenv {' '.join(args)} -> {r.returncode}\n{r.stdout}{r.stderr}"
    return r


@pytest.fixture(scope="module")
def sid(cli_env: dict[str, str]):
    out = aenv(cli_env, "start", "base", "--detach", "--timeout", "600",
               "--metadata", "suite=cli").stdout.strip()
    yield out
    aenv(cli_env, "rm", out, check=False)


# -- auth and errors ------------------------------------------------------------------

def test_auth_flags_write_config_0600_and_is_used(node: Node, cli_env, tmp_path: Path) -> None:
    env = {k: v for k, v in cli_env.items() if k not in ("AENV_API_URL", "AENV_API_KEY")}
    env["AENV_CONFIG_DIR"] = str(tmp_path / "cfg")
    r = aenv(env, "ls", check=False)
    assert r.returncode != 0 and "aenv auth" in r.stderr and "Traceback" not in r.stderr
    aenv(env, "auth", "--url", node.url, "--key", node.api_key)
    path = tmp_path / "cfg" / "config.toml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert node.api_key in path.read_text()
    assert "SANDBOX ID" in aenv(env, "ls").stdout
    # The environment wins over the file.
    bad = aenv({**env, "AENV_API_KEY": "wrong"}, "ls", check=False)
    assert bad.returncode == 1
    assert len(bad.stderr.strip().splitlines()) == 1 and "401" not in bad.stdout
    assert bad.stderr.startswith("aenv: ") and "auth" in bad.stderr
    # A wrong key is refused by `auth` and nothing is written.
    r = aenv({**env, "AENV_CONFIG_DIR": str(tmp_path / "other")}, "auth", "--url", node.url,
             "--key", "wrong", check=False)
    assert r.returncode == 1 and not (tmp_path / "other" / "config.toml").exists()


def test_auth_xdg_config_home(node: Node, cli_env, tmp_path: Path) -> None:
    env = {k: v for k, v in cli_env.items() if k != "AENV_CONFIG_DIR"}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    aenv(env, "auth", "--url", node.url, "--key", node.api_key)
    assert (tmp_path / "aenv" / "config.toml").exists()


def test_auth_prompts(node: Node, cli_env, tmp_path: Path) -> None:
    import pexpect

    env = {**cli_env, "AENV_CONFIG_DIR": str(tmp_path)}
    child = pexpect.spawn(CLI[0], [*CLI[1:], "auth"], env=env, timeout=30)
    child.expect("Server URL")
    child.sendline(node.url)
    # typer's prompt writes "API key:" itself, then getpass turns echo off, flushing what was typed
    # (TCSAFLUSH), and writes its own " ": a key sent before that space was lost, and the
    # CLI waited for it (a fresh clone's run, with the key echoed).
    child.expect_exact("API key: ")
    child.sendline(node.api_key)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    assert node.url in (tmp_path / "config.toml").read_text()


def test_errors_are_one_line_traceback_with_debug(cli_env, sid: str) -> None:
    r = aenv(cli_env, "rm", "zzzz-no-such", check=False)
    assert r.returncode == 1
    assert r.stderr.strip() == "aenv: zzzz-no-such: no sandbox matches 'zzzz-no-such'"
    env = {**cli_env, "AENV_API_URL": "http://127.0.0.1:9"}
    r = aenv(env, "ls", check=False)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "cannot reach" in r.stderr
    r = aenv(env, "--debug", "ls", check=False)
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_ambiguous_prefix() -> None:
    from agentenv.cli.client import _unique
    from agentenv.cli.config import CliError

    assert _unique("ab", ["abc", "xyz"], "sandbox") == "abc"
    assert _unique("abc", ["abc", "abcd"], "sandbox") == "abc"
    with pytest.raises(CliError, match="ambiguous"):
        _unique("ab", ["abc", "abd"], "sandbox")


# -- sandboxes ----------------------------------------------------------------------

def test_ls_table_json_and_filters(cli_env, sid: str) -> None:
    table = aenv(cli_env, "ls").stdout
    assert "SANDBOX ID" in table and sid in table and "suite=cli" in table
    items = json.loads(aenv(cli_env, "ls", "--json").stdout)
    assert any(s["sandboxID"] == sid and s["state"] == "running" for s in items)
    mine = json.loads(aenv(cli_env, "ls", "--json", "--metadata", "suite=cli").stdout)
    assert [s["sandboxID"] for s in mine] == [sid]
    none = json.loads(aenv(cli_env, "ls", "--json", "--metadata", "suite=other").stdout)
    assert none == []
    paused = json.loads(aenv(cli_env, "ls", "--json", "--state", "paused").stdout)
    assert sid not in [s["sandboxID"] for s in paused]


def test_timeout_pause_resume_rm_by_prefix(cli_env) -> None:
    s = aenv(cli_env, "start", "base", "-d", "--timeout", "120").stdout.strip()
    try:
        aenv(cli_env, "timeout", s[:8], "900")
        item = next(i for i in json.loads(aenv(cli_env, "ls", "--json").stdout)
                    if i["sandboxID"] == s)
        from datetime import UTC, datetime
        left = (datetime.fromisoformat(item["endAt"].replace("Z", "+00:00"))
                - datetime.now(UTC)).total_seconds()
        assert 800 < left <= 900
        assert aenv(cli_env, "pause", s[:8]).stdout.strip() == s
        states = {i["sandboxID"]: i["state"]
                  for i in json.loads(aenv(cli_env, "ls", "--json").stdout)}
        assert states[s] == "paused"
        assert aenv(cli_env, "resume", s).stdout.strip() == s
        assert aenv(cli_env, "exec", s, "--", "true").returncode == 0
    finally:
        r = aenv(cli_env, "rm", s, "nosuchsandbox", check=False)
    assert r.returncode == 1 and r.stdout.strip() == s and "nosuchsandbox" in r.stderr
    assert s not in aenv(cli_env, "ls").stdout


def test_exec_streams_apart_and_exit_code(cli_env, sid: str) -> None:
    r = aenv(cli_env, "exec", sid[:10], "--", "sh", "-c",
             "echo out-$((1+1)); echo err-3 >&2; exit 7", check=False)
    assert r.returncode == 7
    assert r.stdout == "out-2\n" and r.stderr == "err-3\n"
    r = aenv(cli_env, "exec", sid, "--", "ls", "-d", "/home/user")
    assert r.stdout == "/home/user\n"
    r = aenv(cli_env, "exec", "-i", sid, "--", "sh", "-c", "wc -l; echo done >&2; exit 4",
             input="a\nb\nc\n", check=False)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (4, "3", "done\n")
    r = aenv(cli_env, "exec", sid, "--", "nosuchcommand", check=False)
    assert r.returncode == 127 and "not found" in r.stderr


def test_fork_and_snapshots(cli_env, sid: str) -> None:
    aenv(cli_env, "exec", sid, "--", "sh", "-c", "echo forked > /home/user/mark")
    children = aenv(cli_env, "fork", sid, "-n", "2").stdout.split()
    try:
        assert len(children) == 2
        for child in children:
            assert aenv(cli_env, "exec", child, "--", "cat", "/home/user/mark").stdout == "forked\n"
    finally:
        aenv(cli_env, "rm", *children)
    results = json.loads(aenv(cli_env, "fork", sid, "-n", "1", "--json").stdout)
    assert len(results) == 1 and results[0]["sandbox"]["sandboxID"]
    aenv(cli_env, "rm", results[0]["sandbox"]["sandboxID"])

    snap = aenv(cli_env, "snapshot", "create", sid, "--name", "cli-snap").stdout.strip()
    assert snap
    listed = json.loads(aenv(cli_env, "snapshot", "ls", "--json", "--sandbox-id", sid).stdout)
    assert [s["snapshotID"] for s in listed] == [snap] and listed[0]["names"] == ["cli-snap"]
    table = aenv(cli_env, "snapshot", "ls").stdout
    assert "SNAPSHOT ID" in table and "cli-snap" in table
    started = aenv(cli_env, "start", "cli-snap", "-d").stdout.strip()
    try:
        assert aenv(cli_env, "exec", started, "--", "cat", "/home/user/mark").stdout == "forked\n"
    finally:
        aenv(cli_env, "rm", started)
    assert aenv(cli_env, "snapshot", "rm", "cli-snap").stdout.strip() == snap
    assert json.loads(aenv(cli_env, "snapshot", "ls", "--json", "--sandbox-id", sid).stdout) == []
    r = aenv(cli_env, "snapshot", "rm", "cli-snap", check=False)
    assert r.returncode == 1 and "no snapshot" in r.stderr


def test_reset_to_the_last_or_a_named_snapshot(cli_env, sid: str) -> None:
    r = aenv(cli_env, "reset", sid, check=False)
    assert r.returncode == 1 and "no snapshot to reset to" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
    aenv(cli_env, "exec", sid, "--", "sh", "-c", "echo one > /home/user/reset.txt")
    snap = aenv(cli_env, "snapshot", "create", sid, "--name", "cli-reset").stdout.strip()
    try:
        aenv(cli_env, "exec", sid, "--", "sh", "-c", "echo two > /home/user/reset.txt")
        r = aenv(cli_env, "reset", sid[:8])
        assert r.stdout.strip() == sid and snap in r.stderr and "expires in" in r.stderr
        assert aenv(cli_env, "exec", sid, "--", "cat", "/home/user/reset.txt").stdout == "one\n"
        aenv(cli_env, "exec", sid, "--", "sh", "-c", "echo two > /home/user/reset.txt")
        r = aenv(cli_env, "reset", sid, "cli-reset", "--timeout", "600", "--json")
        assert json.loads(r.stdout)["snapshotID"] == snap
        assert json.loads(r.stdout)["sandboxID"] == sid
        assert aenv(cli_env, "exec", sid, "--", "cat", "/home/user/reset.txt").stdout == "one\n"
        r = aenv(cli_env, "reset", sid, "no-such-snapshot", check=False)
        assert r.returncode == 1 and "no snapshot matches 'no-such-snapshot'" in r.stderr
        assert "Traceback" not in r.stderr
        # A reset is an event of the sandbox, not a new parent: template -> sandbox ->
        # its snapshot, each once, and no cycle down to the depth limit.
        tree = aenv(cli_env, "snapshot", "tree", "cli-reset").stdout
        lines = [ln for ln in tree.splitlines() if ln.strip()]
        assert len(lines) == 3, tree
        assert "template base" in lines[0] and f"sandbox {sid}" in lines[1], tree
        assert "reset 2x, last to " + snap in lines[1] and f"snapshot {snap}" in lines[2], tree
        data = json.loads(aenv(cli_env, "snapshot", "tree", "cli-reset", "--json").stdout)
        assert [(a["kind"], a["id"]) for a in data["ancestors"]] == [
            ("template", "base"), ("sandbox", sid)]
        assert data["tree"]["children"] == []
        assert [e["snapshotID"] for e in data["ancestors"][1]["resets"]] == [snap, snap]
        # --files (issue 28): the first such reset is a full one, the next in place.
        for in_place in (False, True):
            aenv(cli_env, "exec", sid, "--", "sh", "-c", "echo two > /home/user/reset.txt")
            r = aenv(cli_env, "reset", sid, "cli-reset", "--files")
            assert ("(its files, in place)" in r.stderr) is in_place, r.stderr
            assert aenv(cli_env, "exec", sid, "--", "cat", "/home/user/reset.txt").stdout == \
                "one\n"
    finally:
        aenv(cli_env, "snapshot", "rm", snap)


# -- files --------------------------------------------------------------------------

def test_upload_download_file_and_directory(cli_env, sid: str, tmp_path: Path) -> None:
    src = tmp_path / "tree"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a.txt").write_text("alpha\n")
    (src / "sub" / "b.bin").write_bytes(os.urandom(3 << 20))
    (src / "sub" / "deeper" / "c.txt").write_text("gamma\n")
    r = aenv(cli_env, "upload", sid, str(src), "/home/user/up")
    assert "-> /home/user/up" in r.stderr and "3.1/3.1 MB" in r.stderr  # the progress bar
    listing = aenv(cli_env, "exec", sid, "--", "sh", "-c",
                   "cd /home/user/up && find . | sort && cat sub/deeper/c.txt").stdout
    assert listing.split() == [".", "./a.txt", "./empty", "./sub", "./sub/b.bin", "./sub/deeper",
                               "./sub/deeper/c.txt", "gamma"]
    aenv(cli_env, "upload", sid, str(src / "a.txt"), "/home/user/")
    assert aenv(cli_env, "exec", sid, "--", "cat", "/home/user/a.txt").stdout == "alpha\n"

    out = tmp_path / "down"
    aenv(cli_env, "download", sid, "/home/user/up", str(out))
    assert (out / "sub" / "b.bin").read_bytes() == (src / "sub" / "b.bin").read_bytes()
    assert (out / "sub" / "deeper" / "c.txt").read_text() == "gamma\n"
    assert (out / "empty").is_dir()
    aenv(cli_env, "download", sid, "/home/user/a.txt", str(tmp_path / "a-copy.txt"))
    assert (tmp_path / "a-copy.txt").read_text() == "alpha\n"
    r = aenv(cli_env, "download", sid, "/home/user/none", str(tmp_path / "x"), check=False)
    assert r.returncode == 1 and "no such file" in r.stderr


# -- completion ---------------------------------------------------------------------

@pytest.mark.parametrize(("shell", "marker"), [
    ("bash", "complete -o default -F _aenv_completion aenv"),
    ("zsh", "compdef _aenv_completion aenv"),
    ("fish", "complete --command aenv"),
])
def test_show_completion(shell: str, marker: str) -> None:
    env = {**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    r = subprocess.run([str(AENV), "--show-completion", shell],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert marker in r.stdout and "_AENV_COMPLETE" in r.stdout


# -- interactive shell ----------------------------------------------------------------

def test_start_shell_over_pty_resize_ctrl_d_then_cn(cli_env) -> None:
    import pexpect

    child = pexpect.spawn(CLI[0], [*CLI[1:], "start", "base", "--timeout", "300"], env=cli_env,
                          timeout=60, dimensions=(24, 80), encoding="utf-8")
    child.expect(r"\$ ")  # the prompt
    child.sendline("echo shell-$((6*7)) $(id -un)")
    child.expect("shell-42 user")
    child.sendline("stty size")
    child.expect("24 80")
    child.setwinsize(40, 120)  # SIGWINCH -> the sandbox's PTY follows
    child.sendline("sleep 0.5; stty size")
    child.expect("40 120")
    child.sendline("touch /tmp/was-here")
    # Ctrl-D once the shell reads again: sent while the command runs, the
    # terminal is in canonical mode and the EOF is not kept for readline.
    child.expect("touch /tmp/was-here")
    child.expect(r"\$ ")
    child.send("\x04")  # Ctrl-D leaves the shell
    child.expect(r"aenv cn ([a-z0-9]+)")
    sid = child.match.group(1)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    try:
        child = pexpect.spawn(CLI[0], [*CLI[1:], "cn", sid[:8]], env=cli_env, timeout=60,
                              encoding="utf-8")
        child.sendline("ls /tmp/was-here && exit 3")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 3  # the shell's exit code is the CLI's
    finally:
        aenv(cli_env, "rm", sid)


def test_start_rm_with_piped_stdin(cli_env) -> None:
    """Not a terminal: the shell reads the piped lines; --rm removes the sandbox after."""
    before = {s["sandboxID"] for s in json.loads(aenv(cli_env, "ls", "--json").stdout)}
    r = aenv(cli_env, "start", "base", "--rm", input="echo piped-$((2*21))\nexit 5\n",
             check=False)
    assert r.returncode == 5, r.stderr
    assert "piped-42" in r.stdout
    after = {s["sandboxID"] for s in json.loads(aenv(cli_env, "ls", "--json").stdout)}
    assert after <= before
