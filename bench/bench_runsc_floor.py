"""The bare-runsc floor of an idle sandbox (issue 17), split, and runsc's levers on it.

Starts ``--count`` bare runsc sandboxes (systrap, ``--overlay2=root:memory``, no
network, the `base` template's rootfs read-only) running ``sleep infinity`` for each
variant (extra runsc flags and/or environment), lets them settle, and records per
sandbox:

- PSS of every runsc process (sentry, gofer, systrap stubs), each address space once;
- the sentry's split: its Go heap and other anonymous memory (``Private`` of anonymous
  mappings), the guest memory file (the ``runsc-memory`` memfd mapping), the runsc
  binary's text; and the gofer's PSS;
- the memory cgroup's own counts (``total_rss``: runsc heaps; ``total_shmem``: the
  memory file, including pages no process maps);
- idle CPU of all of them.

Variants run one after another in one process, on the same rootfs and flags, so the
figures compare within one run.

    PYTHONPATH=src:bench python bench/bench_runsc_floor.py --count 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from agentenv.testing.hostmem import same_mm
from bench_density import CG, MIB, bare_bundle, base_rootfs, idle_cpu
from common import write

PREFIX = "h2fl"
BASE_FLAGS = ["--platform=systrap", "--network=none", "--overlay2=root:memory"]
SLEEP = ["sleep", "infinity"]
# What envd cannot go below as a Python program: the interpreter, and asyncio (envd's
# server loop), idle in a bare sandbox.
PY_BARE = ["python3", "-S", "-c", "import time; time.sleep(1 << 30)"]
PY_ASYNCIO = ["python3", "-c", "import asyncio; asyncio.run(asyncio.sleep(1 << 30))"]
# name -> (extra runsc flags, extra environment for runsc, the sandbox's command)
VARIANTS: dict[str, tuple[list[str], dict[str, str], list[str]]] = {
    "default": ([], {}, SLEEP),
    "GOGC=25": ([], {"GOGC": "25"}, SLEEP),
    "GOMEMLIMIT=8MiB": ([], {"GOMEMLIMIT": "8MiB"}, SLEEP),
    "buffer-pooling=false": (["--buffer-pooling=false"], {}, SLEEP),
    "directfs=false": (["--directfs=false"], {}, SLEEP),
    "dcache=200": (["--dcache=200"], {}, SLEEP),
    "platform=ptrace": (["--platform=ptrace"], {}, SLEEP),
    "python3 -S idle": ([], {}, PY_BARE),
    "python3 asyncio idle": ([], {}, PY_ASYNCIO),
}


def smaps(pid: int) -> list[dict]:
    """The mappings of a process: name, Pss, Private (dirty + clean), Rss in bytes."""
    out: list[dict] = []
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            head = line.split()
            if not head:
                continue
            if "-" in head[0] and not head[0].endswith(":"):
                out.append({"name": head[5] if len(head) > 5 else "[anon]", "Pss": 0,
                            "Private": 0, "Rss": 0})
            elif head[0] in ("Pss:", "Rss:"):
                out[-1][head[0][:-1]] += int(head[1]) * 1024
            elif head[0] in ("Private_Clean:", "Private_Dirty:"):
                out[-1]["Private"] += int(head[1]) * 1024
    return out


def comm(pid: int) -> str:
    """runsc's role of a process (argv[0]: runsc-sandbox, runsc-gofer; stubs have none)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    return "?"


def split(cgroup: Path) -> dict[str, float]:
    """One sandbox's memory, split (bytes)."""
    parts = {"pss": 0, "sentry_anon_private": 0, "sentry_memfile_pss": 0,
             "sentry_text_pss": 0, "sentry_pss": 0, "gofer_pss": 0, "stubs_pss": 0}
    firsts: list[int] = []
    pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    for pid in pids:
        if any(same_mm(pid, other) for other in firsts):
            continue
        firsts.append(pid)
        maps = smaps(pid)
        pss = sum(m["Pss"] for m in maps)
        parts["pss"] += pss
        name = comm(pid)
        if name == "runsc-sandbox":
            parts["sentry_pss"] += pss
            for m in maps:
                if "runsc-memory" in m["name"] or "memfd:" in m["name"]:
                    parts["sentry_memfile_pss"] += m["Pss"]
                elif m["name"].endswith("runsc") or "/runsc" in m["name"]:
                    parts["sentry_text_pss"] += m["Pss"]
                elif m["name"].startswith("[") or m["name"] == "[anon]":
                    parts["sentry_anon_private"] += m["Private"]
        elif name == "runsc-gofer":
            parts["gofer_pss"] += pss
        else:
            parts["stubs_pss"] += pss
    with contextlib.suppress(OSError):
        for line in (cgroup / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("total_rss", "total_shmem"):
                parts["cg_" + key] = int(value)
    env_seen = ""
    with contextlib.suppress(OSError):
        for pid in pids:
            if comm(pid) in ("runsc-sandbox", "runsc-gofer"):
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                go = [e.decode() for e in env if e.startswith((b"GOGC", b"GOMEM"))]
                env_seen += f"{comm(pid)}: {' '.join(go) or '-'}; "
    return {**parts, "env_seen": env_seen}  # type: ignore[dict-item]


def run_variant(name: str, flags: list[str], env: dict[str, str], argv: list[str], count: int,
                rootfs: Path, settle: float, window: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix="aenv-floor-"))
    cg = f"{PREFIX}{abs(hash(name)) % 10000}"
    root = work / "state"
    all_flags = [f"--root={root}", *BASE_FLAGS, *flags]
    # a later --platform overrides the base one (runsc's flag parser keeps the last)
    ids = [f"f{i}" for i in range(count)]
    try:
        for sid in ids:
            bundle = work / sid
            bundle.mkdir(parents=True)
            bare_bundle(bundle, argv, rootfs, f"/{cg}/{sid}")
            subprocess.run(["runsc", *all_flags, "run", "--detach", "--bundle", str(bundle), sid],
                           check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={**os.environ, **env})
        time.sleep(settle)
        cpu = idle_cpu(cg, window)
        splits = [split(CG / "memory" / cg / sid) for sid in ids]
        keys = [k for k in splits[0] if k != "env_seen"]
        row: dict = {"variant": name, "sandboxes": count,
                     "idle_cpu_pct_each": round(cpu / count, 2)}
        for k in keys:
            row[k + "_MiB"] = round(sum(s[k] for s in splits) / count / MIB, 1)
        row["env_seen"] = splits[0]["env_seen"]
        return row
    finally:
        for sid in ids:
            subprocess.run(["runsc", *all_flags, "delete", "--force", sid], check=False,
                           capture_output=True)
        for sub in ("freezer", "memory", "cpu", "cpuacct", "pids", "cpuset", "devices",
                    "blkio", "systemd", "net_cls", "net_prio", "perf_event", "hugetlb"):
            for d in [*(CG / sub / cg / sid for sid in ids), CG / sub / cg]:
                with contextlib.suppress(OSError):
                    d.rmdir()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=4, help="sandboxes per variant")
    ap.add_argument("--settle", type=float, default=8)
    ap.add_argument("--window", type=float, default=10, help="idle CPU window, seconds")
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    ap.add_argument("--name", default="runsc_floor")
    args = ap.parse_args()
    rootfs = base_rootfs()
    rows = []
    for name, (flags, env, argv) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        row = run_variant(name, flags, env, argv, args.count, rootfs, args.settle, args.window)
        row["load_1m"] = round(os.getloadavg()[0], 2)
        rows.append(row)
        print(row, flush=True)
    cols = [k for k in rows[0] if k != "env_seen"]
    text = (f"## The bare-runsc floor, split, per idle sandbox ({args.count} bare sandboxes "
            f"per variant, `sleep infinity`, systrap, `--overlay2=root:memory`, "
            f"`base` rootfs)\n\n| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols) + "\n")
    for row in rows:
        text += "| " + " | ".join(str(row.get(c, "")) for c in cols) + " |\n"
    text += ("\nPSS: each address space once. sentry_anon_private: the sentry's private "
             "anonymous memory (Go heap, stacks). sentry_memfile_pss: its mapping of the guest "
             "memory file. cg_total_rss / cg_total_shmem: the memory cgroup's counts (runsc "
             "heaps / memory file, whether mapped or not). env_seen: GOGC/GOMEMLIMIT in the "
             "sentry's and gofer's environments (runsc starts the sentry with an empty one).\n")
    text += "\n" + "\n".join(f"- {r['variant']}: env_seen {r['env_seen']!r}" for r in rows) + "\n"
    write(args.name, {"rows": rows, "args": vars(args)}, text)


if __name__ == "__main__":
    main()
