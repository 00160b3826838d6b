"""Where an idle sandbox's memory goes (issue 17), on a node of this benchmark's own.

1. ``--sandboxes`` idle ``base`` sandboxes after one command and one file write each
   (their file workers gone, 40 s later): per sandbox, the memory cgroup's memory file
   (``total_shmem``: the guest's anonymous memory and tmpfs) and runsc's own anonymous
   memory (``total_rss``: sentry and gofer heaps), PSS, and the guest's view (smaps
   ``Anonymous``) of each envd process; the memory file again while a file worker lives.
2. What envd's imports cost inside a sandbox: its bundle's interpreter importing, one
   step at a time, what envd imports (guest ``Anonymous`` and RSS after each step).
3. Whether gVisor hands freed guest memory back to the host: a process in a sandbox
   touches 200 MiB in 4 MiB buffers and 1.5 M small objects, frees them, then exits;
   the memory file is read after each step.
4. Whether template files are cached per sandbox: every sandbox reads ~40 big shared
   libraries and 3000 files of the template; the memory file before and after.

    PYTHONPATH=src:bench python bench/bench_envd_memory.py --name envd_memory
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from e2b import AsyncSandbox

from agentenv.testing import Node, leaks, sdk_env
from bench_density import MIB, cgroup_memory, cgroup_pss
from common import write

BUNDLE_PY = ("/.aenv/lib/ld-linux-x86-64.so.2 --library-path /.aenv/lib "
             "/.aenv/python/bin/python3.11 -S")
BUNDLE_ENV = {"PYTHONHOME": "/.aenv/python", "PYTHONPATH": "/.aenv/site"}
GUEST_ANON = """
import os
out = {}
for p in os.listdir('/proc'):
    if not p.isdigit():
        continue
    try:
        if not open(f'/proc/{p}/cmdline').read().startswith('/.aenv/lib/'):
            continue
        out[p] = sum(int(l.split()[1]) for l in open(f'/proc/{p}/smaps')
                     if l.startswith('Anonymous:'))
    except OSError:
        pass
print(out)
"""
IMPORT_STEPS = """
import importlib, sys, time
def mem():
    a = r = 0
    for l in open('/proc/self/smaps'):
        if l.startswith('Anonymous:'): a += int(l.split()[1])
        elif l.startswith('Rss:'): r += int(l.split()[1])
    return a, r
steps = ['asyncio', 'json', 'uuid', 'ctypes', 'hashlib', 'agentenv.envd.state',
         'agentenv.envd.userfs', 'agentenv.envd.disk_capture', 'agentenv.envd.files_http',
         'protobuf', 'aenv_envd_protos.process.process_pb',
         'aenv_envd_protos.filesystem.filesystem_pb', 'pyqwest', 'connectrpc.errors',
         'connectrpc.server', 'aenv_envd_protos.process.process_connect',
         'aenv_envd_protos.filesystem.filesystem_connect', 'agentenv.envd.process',
         'agentenv.envd.filesystem', 'agentenv.envd.server', 'agentenv.envd.oom',
         'agentenv.envd.__main__', 'uvicorn.config', 'uvicorn.server',
         'uvicorn.protocols.http.h11_impl', 'tarfile', 'click', 'importlib.metadata']
prev = mem()
rows = [['interpreter (-S)', prev[0], prev[1], len(sys.modules), 0]]
for m in steps:
    if m == 'uvicorn.config':  # as envd does: without uvicorn's package __init__
        try:
            from agentenv.envd.__main__ import _uvicorn_core
            _uvicorn_core()
        except ImportError:  # an envd from before that
            import uvicorn
    n, t = len(sys.modules), time.perf_counter()
    importlib.import_module(m)
    now = mem()
    rows.append([m, now[0] - prev[0], now[1] - prev[1], len(sys.modules) - n,
                 round((time.perf_counter() - t) * 1000)])
    prev = now
rows.append(['total', prev[0], prev[1], len(sys.modules), 0])
print(rows)
"""
FREE = """
import time, sys
big = [bytearray(4 << 20) for _ in range(50)]
for b in big:
    for i in range(0, len(b), 4096): b[i] = 1
small = [str(i) * 3 for i in range(1_500_000)]
print('allocated', flush=True); time.sleep(4)
del big; print('freed big', flush=True); time.sleep(4)
del small; print('freed small', flush=True); time.sleep(4)
"""
READ_TEMPLATE = ("cat $(find /usr/lib -name '*.so*' -size +1M | head -40) > /dev/null; "
                 "find /usr -type f | head -3000 | xargs cat > /dev/null 2>&1; true")


def per_sandbox(prefix: str) -> dict:
    shmem, rss, count = cgroup_memory(prefix)
    pss = cgroup_pss(prefix)[0]
    n = max(count, 1)
    return {"memfile_MiB": round(shmem / n / MIB, 1), "runsc_anon_MiB": round(rss / n / MIB, 1),
            "pss_MiB": round(pss / n / MIB, 1)}


def one_memfile(prefix: str, sid: str) -> float:
    root = Path("/sys/fs/cgroup/memory") / prefix
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith(sid):
            for line in (child / "memory.stat").read_text().splitlines():
                if line.startswith("total_shmem "):
                    return round(int(line.split()[1]) / MIB, 1)
    return -1.0


async def run(prefix: str, count: int) -> dict:
    out: dict = {}
    sbxs = [await AsyncSandbox.create("base", timeout=900) for _ in range(count)]
    for s in sbxs:
        await s.commands.run("true")
        await s.files.write("/tmp/x", "x")
    out["with_a_file_worker"] = per_sandbox(prefix)
    await asyncio.sleep(40)  # file workers leave after 30 s idle
    out["idle"] = per_sandbox(prefix)
    probe = sbxs[0]
    await probe.files.write("/tmp/g.py", GUEST_ANON)
    res = await probe.commands.run(f"{BUNDLE_PY} /tmp/g.py", envs=BUNDLE_ENV, user="root")
    out["guest_anon_kB_of_envd_processes"] = ast.literal_eval(res.stdout.strip())
    await probe.files.write("/tmp/imports.py", IMPORT_STEPS)
    res = await probe.commands.run(f"{BUNDLE_PY} /tmp/imports.py", envs=BUNDLE_ENV,
                                   user="root", timeout=300)
    out["imports"] = ast.literal_eval(res.stdout.strip())
    # 3. freed memory back to the host
    sid = probe.sandbox_id.split("-")[0]
    steps = [("before", one_memfile(prefix, sid))]
    await probe.files.write("/tmp/free.py", FREE)
    handle = await probe.commands.run(
        "python3 /tmp/free.py", background=True,
        on_stdout=lambda line: steps.append((line.strip(), one_memfile(prefix, sid))))
    await handle.wait()
    await asyncio.sleep(3)
    steps.append(("process exited, 3 s later", one_memfile(prefix, sid)))
    out["free"] = steps
    # 4. template files read in every sandbox
    before = per_sandbox(prefix)
    for s in sbxs:
        await s.commands.run(READ_TEMPLATE, timeout=300)
    out["template_reads"] = {"before": before, "after": per_sandbox(prefix)}
    for s in sbxs:
        await s.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=3)
    ap.add_argument("--prefix", default="bem")
    ap.add_argument("--cidr", default="10.104.0.0/16")
    ap.add_argument("--name", default="envd_memory")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="aenv-envdmem-"))
    node = Node(home, args.prefix, args.cidr, AENV_IDLE_FREEZE_S="0")
    node.start()
    try:
        with sdk_env(node.e2b_env()):
            out = asyncio.run(run(args.prefix, args.sandboxes))
    finally:
        node.stop()
        left = leaks(args.prefix, home)
        shutil.rmtree(home, ignore_errors=True)
    text = (f"## Where an idle sandbox's memory goes ({args.sandboxes} idle `base` "
            f"sandboxes, {time.strftime('%Y-%m-%d')})\n\n"
            f"Per sandbox, idle: {out['idle']}; with a file worker alive: "
            f"{out['with_a_file_worker']}.\nGuest `Anonymous` of envd's processes (kB): "
            f"{out['guest_anon_kB_of_envd_processes']}.\n\n### envd's imports in a sandbox\n\n"
            "| step | anon +kB | rss +kB | modules | ms |\n| --- | --- | --- | --- | --- |\n")
    for row in out["imports"]:
        text += "| " + " | ".join(str(x) for x in row) + " |\n"
    text += "\n### Freed guest memory (memory file of one sandbox, MiB)\n\n"
    text += "\n".join(f"- {step}: {mib}" for step, mib in out["free"])
    reads = out["template_reads"]
    text += (f"\n\n### Template files read in every sandbox\n\nbefore {reads['before']}, "
             f"after {reads['after']}\n\nLeft behind: {left}\n")
    write(args.name, {**out, "leaks": left}, text)


if __name__ == "__main__":
    main()
