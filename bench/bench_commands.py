"""What one command costs (issue 15, item 4): the SDK runs each as `bash -l -c CMD` as
`user` in template base. Measured in one sandbox, beside bare runsc in the same run:

- inside the sandbox, a bash loop timing each spawn with $EPOCHREALTIME (the floor
  gVisor sets: fork + exec of /bin/true; a plain `bash -c`; the login shell; `id -u`,
  which /etc/profile used to run);
- from the host, the round trip through the node's proxy and envd (Process.Start
  until the end event) of `/bin/true` as root and as user (envd starts a user's
  command through exec-as, or setpriv in a bundle without it) and of the SDK's
  `bash -l -c true`;
- the credential switch envd puts in front of a user's command (spawn.py), timed
  inside by Python's Popen + wait as envd spawns it (a vfork): none (root), the
  bundle's exec-as, util-linux's setpriv through the bundle's loader;
- the SDK itself: `Sandbox.commands.run("true")` (the e2b Python SDK, default user).

Before/after two trees: runs of each alternated with `--name LABEL_i` (the node runs the
tree on PYTHONPATH), then `--compare BEFORE_1,BEFORE_2 AFTER_1,AFTER_2` for the table
(the exec-as change's, retired: `git show ba2a28a:bench/results/commands_exec_as.md`).

`--profile-fix` also times the login shell with the base template's /etc/profile
edited as scripts/build-base-template.sh now edits it (in that sandbox only), for a
template built before the edit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from agentenv.testing import Node, leaks, sdk_env
from bench_node import run_native as run
from bench_node import runsc_do_true
from common import RESULTS, summary, table, write

# The edit build-base-template.sh makes (bash knows its EUID: no `id` process).
PROFILE_FIX = r"""sed -i 's/"\$(id -u)"/"${EUID:-$(id -u)}"/' /etc/profile"""


def inside(http: httpx.Client, sid: str, token: str, cmd: str, n: int) -> list[float]:
    """Seconds per run of ``cmd``, timed inside the sandbox by bash itself."""
    script = (f"for i in $(seq {n}); do a=$EPOCHREALTIME; {cmd} >/dev/null; b=$EPOCHREALTIME; "
              "echo $a $b; done")
    code, out = run(http, sid, token, ["/bin/bash", "-c", script])
    if code != 0:
        raise RuntimeError(f"{cmd}: exit {code}")
    return [float(b) - float(a) for a, b in (line.split() for line in out.splitlines())]


# Process.Start of /bin/true straight to envd from inside the sandbox (python3 of
# base, http.client): envd's own cost, without the node's proxy and the host's network.
DIRECT = r"""
import http.client, json, os, struct, time
msg = json.dumps({"process": {"cmd": "/bin/true"}}).encode()
body = b"\x00" + struct.pack(">I", len(msg)) + msg
hdr = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
       "X-Access-Token": os.environ["TOKEN"], "Authorization": "Basic dXNlcjo="}
c = http.client.HTTPConnection("127.0.0.1", 49983)
for _ in range(int(os.environ["N"])):
    t0 = time.perf_counter()
    c.request("POST", "/process.Process/Start", body, hdr)
    r = c.getresponse(); data = r.read()
    assert r.status == 200 and b'"end"' in data, data[:200]
    print(time.perf_counter() - t0)
"""


def direct(http: httpx.Client, sid: str, token: str, n: int) -> list[float]:
    code, out = run(http, sid, token, ["/usr/bin/python3", "-c", DIRECT], "user",
                    {"TOKEN": token, "N": str(n)})
    if code != 0:
        raise RuntimeError(f"direct Process.Start: exit {code}")
    return [float(x) for x in out.split()]


# Popen + wait of each command inside the sandbox, as envd spawns a user's command.
SWITCH = r"""
import os, subprocess, sys, time
n = int(os.environ["N"])
L = ["/.aenv/lib/ld-linux-x86-64.so.2", "--library-path", "/.aenv/lib", "/.aenv/bin/setpriv",
     "--reuid=1000", "--regid=1000", "--groups", "1000", "--"]
E = ["/.aenv/bin/exec-as", "1000", "1000", "1000"]
env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/user", "USER": "user"}
cases = {"none (root)": [], "setpriv": L}
if os.access(E[0], os.X_OK):
    cases["exec-as"] = E
for cmd in (["/bin/true"], ["/bin/bash", "-l", "-c", "true"]):
    for name, pre in cases.items():
        for _ in range(n):
            t0 = time.perf_counter()
            subprocess.Popen(pre + cmd, env=env, start_new_session=True).wait()
            print(f"{' '.join(cmd)}|{name}|{time.perf_counter() - t0}")
"""


def switch(http: httpx.Client, sid: str, token: str, n: int) -> dict[str, list[float]]:
    code, out = run(http, sid, token, ["/usr/bin/python3", "-c", SWITCH], "root", {"N": str(n)})
    if code != 0:
        raise RuntimeError(f"credential switch timing: exit {code}")
    xs: dict[str, list[float]] = {}
    for line in out.splitlines():
        cmd, name, t = line.split("|")
        xs.setdefault(f"inside: Popen {cmd}, switch: {name}", []).append(float(t))
    return xs


def sdk_runs(node: Node, sid: str, n: int) -> list[float]:
    """``commands.run("true")`` through the e2b SDK, as a user of it sees it."""
    from e2b import Sandbox

    with sdk_env(node.e2b_env()):
        sbx = Sandbox.connect(sid)
        sbx.commands.run("true")  # the SDK's own first-call set-up out of the figures
        xs = []
        for _ in range(n):
            t0 = time.perf_counter()
            sbx.commands.run("true")
            xs.append(time.perf_counter() - t0)
    return xs


def round_trips(http: httpx.Client, sid: str, token: str, argv: list[str], user: str,
                n: int) -> list[float]:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        code, _ = run(http, sid, token, argv, user)
        xs.append(time.perf_counter() - t0)
        if code != 0:
            raise RuntimeError(f"{argv}: exit {code}")
    return xs


def compare(before: list[str], after: list[str]) -> str:
    """A table of the p50 of each row in every run named, before and after, with the
    median of each side: runs alternated before/after on a busy machine."""
    def load(name: str) -> dict[str, dict]:
        return json.loads((RESULTS / f"{name}.json").read_text())["rows"]

    b, a = [load(n) for n in before], [load(n) for n in after]
    lines = ["| step | before p50 ms (each run) | after p50 ms (each run) | before | after |",
             "| --- | --- | --- | --- | --- |"]
    for row in dict.fromkeys([*b[0], *a[0]]):
        bs = [r[row]["p50_ms"] for r in b if row in r]
        as_ = [r[row]["p50_ms"] for r in a if row in r]
        med = [f"{statistics.median(xs):.1f}" if xs else "" for xs in (bs, as_)]
        lines.append(f"| {row} | {' / '.join(map(str, bs))} | {' / '.join(map(str, as_))} | "
                     f"{med[0]} | {med[1]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=60, help="runs of each command")
    ap.add_argument("--profile-fix", action="store_true",
                    help="also time the login shell with /etc/profile edited in the sandbox")
    ap.add_argument("--name", default="commands", help="results file name")
    ap.add_argument("--cidr", default="10.17.0.0/16", help="the node's address pool")
    ap.add_argument("--prefix", default="aec", help="the node's network prefix")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE,...", "AFTER,..."),
                    help="print a before/after table of result files already written")
    args = ap.parse_args()
    if args.compare:
        print(compare(*(names.split(",") for names in args.compare)), end="")
        return

    prefix = args.prefix
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
    node = Node(home, prefix, args.cidr, AENV_TEMPLATE_SNAPSHOTS="false")
    node.start()
    rows: dict[str, dict] = {}
    try:
        with node.client() as api, httpx.Client(base_url=node.url, timeout=120) as http:
            r = api.post("/sandboxes", json={"templateID": "base", "timeout": 600})
            r.raise_for_status()
            sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
            rows["baseline: runsc do /bin/true (host)"] = summary(
                [runsc_do_true() for _ in range(10)])
            for label, cmd in (("inside: /bin/true (fork + exec)", "/bin/true"),
                               ("inside: id -u", "id -u"),
                               ("inside: bash -c true", "bash -c true"),
                               ("inside: bash -l -c true (login shell)", "bash -l -c true")):
                rows[label] = summary(inside(http, sid, token, cmd, args.n))
            for label, xs in switch(http, sid, token, args.n).items():
                rows[label] = summary(xs)
            rows["inside: envd Process.Start of /bin/true as user (direct, keep-alive)"] = \
                summary(direct(http, sid, token, args.n))
            for label, argv, user in (
                    ("round trip: /bin/true as root", ["/bin/true"], "root"),
                    ("round trip: /bin/true as user (credential switch)", ["/bin/true"], "user"),
                    ("round trip: bash -l -c true as user (SDK style)",
                     ["/bin/bash", "-l", "-c", "true"], "user")):
                rows[label] = summary(round_trips(http, sid, token, argv, user, args.n))
            rows['SDK: commands.run("true") (e2b Python SDK)'] = summary(
                sdk_runs(node, sid, args.n))
            if args.profile_fix:
                code, _ = run(http, sid, token, ["/bin/bash", "-c", PROFILE_FIX], "root")
                if code != 0:
                    raise RuntimeError("editing /etc/profile failed")
                rows["inside: bash -l -c true, /etc/profile edited"] = summary(
                    inside(http, sid, token, "bash -l -c true", args.n))
                rows["round trip: bash -l -c true as user, /etc/profile edited"] = summary(
                    round_trips(http, sid, token, ["/bin/bash", "-l", "-c", "true"], "user",
                                args.n))
            rows["baseline: runsc do /bin/true (host), after"] = summary(
                [runsc_do_true() for _ in range(10)])
            api.delete(f"/sandboxes/{sid}")
    finally:
        node.stop()
    base = statistics.median([rows["baseline: runsc do /bin/true (host)"]["p50_ms"],
                              rows["baseline: runsc do /bin/true (host), after"]["p50_ms"]])
    for s in rows.values():
        if "p50_ms" in s:
            s["p50_over_runsc_do"] = round(s["p50_ms"] / base, 3)
    text = table("Per command: one sandbox of template base (user `user`)", rows)
    left = leaks(prefix, home)
    if left:
        text += f"\nLeft behind: {left}\n"
    write(args.name, {"rows": rows, "leaks": left}, text)


if __name__ == "__main__":
    main()
