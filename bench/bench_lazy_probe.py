"""What lazy image loading could save, measured (docs/lazy-images.md).

1. The working set: the base rootfs pulled as an image (one zstd layer) on a node,
   a sandbox booted from it (template snapshots off), then a first command. A
   fanotify mark on the image's overlay mount (the whole superblock, so the runsc
   gofer's opens in its own mount namespace count) reports every file opened and
   read; the bytes of those files are what a sandbox needed before (and during) its
   first command. (atime cannot tell: gVisor opens host files with O_NOATIME.)
2. What an index-only pass over a plain layer costs: ``zstd -d`` of the layer to
   /dev/null (a tar is not seekable, so listing it decompresses everything) against
   ``tar --zstd -x`` of it and against reading it (``cat`` to /dev/null).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import zstandard
from e2b import Sandbox

from agentenv.testing import SHARED_HOME, Node, leaks, sdk_env
from agentenv.testing.oci_registry import RegistryServer, build_image, tar_tree
from common import table, write

BASE = SHARED_HOME / "images" / "templates" / "base" / "rootfs"
COMMANDS = {"true": "true", "python3 -c 'import json, ssl'": "python3 -c 'import json, ssl'",
            "git --version; ls /usr/bin | wc -l": "git --version; ls /usr/bin | wc -l"}


class Opens:
    """fanotify (FAN_CLASS_NOTIF) over one filesystem: the paths of files opened."""

    def __init__(self, path: Path):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64,
                                       ctypes.c_int, ctypes.c_char_p]
        self.fd = libc.fanotify_init(0x0, os.O_RDONLY | os.O_LARGEFILE)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "fanotify_init")
        # FAN_MARK_ADD | FAN_MARK_FILESYSTEM; FAN_OPEN | FAN_ACCESS
        if libc.fanotify_mark(self.fd, 0x1 | 0x100, 0x20 | 0x1, -100, bytes(path)) < 0:
            raise OSError(ctypes.get_errno(), "fanotify_mark")
        self.paths: set[str] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if not ready:
                continue
            buf = os.read(self.fd, 65536)
            off = 0
            while off + 24 <= len(buf):
                length, _, _, _, _, fd, _ = struct.unpack_from("=IBBHQii", buf, off)
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        self.paths.add(os.readlink(f"/proc/self/fd/{fd}"))
                    os.close(fd)
                off += length

    def close(self) -> set[str]:
        time.sleep(0.5)
        self._stop = True
        self._thread.join()
        os.close(self.fd)
        return self.paths


def tree_size(root: Path) -> tuple[int, int]:
    n = b = 0
    for d, _, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(d, name))
            if stat.S_ISREG(st.st_mode):
                n += 1
                b += st.st_size
    return n, b


def _under(mount: Path, path: str) -> str:
    """The path in this mount namespace: runsc's own has the rootfs at ``/root``."""
    if path.startswith(str(mount)):
        return path
    return str(mount / path.removeprefix("/root/").lstrip("/"))


def opened(paths: set[str]) -> tuple[int, int]:
    n = b = 0
    for p in paths:
        with contextlib.suppress(OSError):
            st = os.stat(p)
            if stat.S_ISREG(st.st_mode):
                n += 1
                b += st.st_size
    return n, b


def timed(argv: list[str] | str, shell: bool = False) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, shell=shell, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-lazy-"))
    base = tar_tree(BASE, work / "base.tar")
    layer = work / "base.tar.zst"
    layer.write_bytes(zstandard.ZstdCompressor(level=3, threads=-1).compress(base.read_bytes()))
    rows: dict[str, dict] = {}
    passes = {"read the layer (cat)": f"cat {layer} > /dev/null",
              "decompress only (zstd -d, an index pass)": f"zstd -dc {layer} > /dev/null",
              "tar --zstd -x (full unpack)": f"mkdir {work}/x && tar -C {work}/x --zstd -xf "
                                            f"{layer} && sync -f {work}/x"}
    for name, cmd in passes.items():
        rows[name] = {"s": round(timed(cmd, shell=True), 2),
                      "layer_MB": round(layer.stat().st_size / 1e6, 1)}
    shutil.rmtree(work / "x", ignore_errors=True)
    registry = RegistryServer(work / "registry").start()
    node = Node(work / "home", "xlz", "10.111.0.0/16", AENV_TEMPLATE_SNAPSHOTS="false")
    node.start()
    try:
        ref = registry.push("bench/lazy", "v1", build_image([base.read_bytes()], ["zstd"]))
        with node.client() as api, api.stream("POST", "/images", timeout=600,
                                             json={"image": ref, "name": "lazy"}) as r:
            assert r.status_code == 200
            r.read()
        rootfs = node.home / "run" / "rootfs"
        with sdk_env(node.e2b_env()):
            warm = Sandbox.create(template="lazy", timeout=60)  # mounts the layers
            mount = next(p for p in rootfs.iterdir() if os.path.ismount(p))
            n_all, b_all = tree_size(mount)
            watch = Opens(mount)
            sbx = Sandbox.create(template="lazy", timeout=120)
            sbx.commands.run("true")
            paths = set(watch.paths)
            for label, cmd in [("boot + first command (true)", None), *[
                    (f"... then {k}", v) for k, v in list(COMMANDS.items())[1:]]]:
                if cmd:
                    sbx.commands.run(cmd)
                    time.sleep(0.5)
                    paths = set(watch.paths)
                n, b = opened({_under(mount, p) for p in paths})
                rows[label] = {"files_opened": n, "MB_of_them": round(b / 1e6, 1),
                               "files": n_all, "MB": round(b_all / 1e6, 1),
                               "pct_bytes": round(100 * b / b_all, 1)}
            watch.close()
            print(f"{len(paths)} paths opened, e.g. {sorted(paths)[:5]}")
            sbx.kill()
            warm.kill()
    finally:
        code = node.stop()
        registry.stop()
    left = leaks("xlz", work / "home")
    shutil.rmtree(work, ignore_errors=True)
    text = table("Lazy loading probe: index pass cost and a sandbox's working set", rows)
    text += f"\nnode exit {code}, leaks {left or 'none'}\n"
    write("lazy_probe", {"rows": rows, "node_exit": code, "leaks": left}, text)


if __name__ == "__main__":
    main()
