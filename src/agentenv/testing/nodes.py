"""Runs real node servers for tests and finds what they might leak."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from ..snapshot.errors import SnapshotError
from .ports import listening_socket
from .template_images import export_images, import_images

# The `aenv` entry point installed next to this interpreter (the venv's bin).
AENV = Path(sys.executable).parent / "aenv"
SHARED_HOME = Path(os.environ.get("AENV_HOME", "/var/lib/aenv"))
# Boot images of the shared templates, handed from node to node (template_images).
IMAGE_SEED = SHARED_HOME / "cache" / "test-template-images"


def free_cidr(first: int, count: int, seed: int) -> str:
    """A 10.N.0.0/16 with N in first..first+count-1, starting at ``seed`` (mod count),
    that no host address is in yet: two test runs on one machine (or one run beside a
    benchmark's node) must not route one node's slot addresses to the other's."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                         text=True).stdout
    used = {int(f.split(".")[1]) for f in out.split() if f.startswith("10.") and "." in f[3:]}
    for i in range(count):
        n = first + (seed + i) % count
        if n not in used:
            return f"10.{n}.0.0/16"
    return f"10.{first + seed % count}.0.0/16"


class Node:
    """One `aenv server` process with its own home, network prefix and address pool."""

    # Whether its repository takes the shared templates' boot images from the seed and
    # gives its own back (template_images); a test of the cold path sets it False.
    seed_images = True

    def __init__(self, home: Path, prefix: str, cidr: str, **env: str):
        self.home = home
        self.prefix = prefix
        self.cidr = cidr
        self.env = {
            **os.environ,
            "AENV_HOME": str(home),
            # Templates and envd bundles are built once by `make` and shared.
            "AENV_IMAGES_DIR": str(SHARED_HOME / "images"),
            "AENV_BUNDLE_DIR": str(SHARED_HOME / "cache" / "bundles"),
            "AENV_NET_PREFIX": prefix,
            "AENV_NET_POOL_CIDR": cidr,
            "AENV_NET_POOL_LOW": "2",
            "AENV_NET_POOL_HIGH": "4",
            # The test nets the egress tests' "outside" namespaces use (10.250-251.x):
            # private networks are refused to sandboxes unless opened.
            "AENV_EGRESS_PRIVATE_OPEN": "10.250.0.0/15",
            # A test or benchmark killed (with its shell, say) takes its node with it.
            "AENV_EXIT_WITH_PARENT": str(os.getpid()),
            **env,
        }
        self.proc: subprocess.Popen | None = None
        self.log_path = home / "server.log"
        # The port is the node's from here on: bound now and handed to the server's
        # process at start (agentenv.testing.ports), bound again on a restart.
        self.host = self.env.get("AENV_HOST", "127.0.0.1")
        self._listener: socket.socket | None = listening_socket(self.host)
        self.port: int = self._listener.getsockname()[1]

    def _release_port(self) -> None:
        """For a subclass that serves elsewhere (its own netns, its own port)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str:
        return (self.home / "secrets" / "api-key").read_text().strip()

    def _share_images(self, copy: Callable[[Path, Path, Path], list[str]], *,
                      into_seed: bool) -> None:
        if not self.seed_images or \
                self.env.get("AENV_SNAPSHOT_BACKEND", "posix_fs") != "posix_fs":
            return
        repo = Path(self.env.get("AENV_SNAPSHOT_PATH") or self.home / "snapshots")
        src, dst = (repo, IMAGE_SEED) if into_seed else (IMAGE_SEED, repo)
        with contextlib.suppress(OSError, SnapshotError):
            copy(src, dst, SHARED_HOME)

    def start(self, wait: float = 90) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self._share_images(import_images, into_seed=False)
        log = open(self.log_path, "ab")
        sock, self._listener = self._listener or listening_socket(self.host, self.port), None
        try:
            self.proc = subprocess.Popen(
                [str(AENV), "server", "--host", self.host, "--port", str(self.port),
                 "--fd", str(sock.fileno())],
                env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True, pass_fds=(sock.fileno(),),
            )
        finally:
            sock.close()  # the server's now: a stopped node's port refuses connections
            log.close()
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()  # a node that never became healthy is not left running
        raise RuntimeError(f"node did not become healthy:\n{self.log_tail()}")

    def stop(self, timeout: float = 60) -> int:
        code = self._stop(timeout)
        self._share_images(export_images, into_seed=True)
        return code

    def _stop(self, timeout: float) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # its stacks go to the log first
            time.sleep(1)
            self.proc.kill()
            return self.proc.wait()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def client(self, key: str | None = "") -> httpx.Client:
        headers = {"X-API-Key": self.api_key if key == "" else key} if key is not None else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def e2b_env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key}


@contextlib.contextmanager
def sdk_env(env: dict[str, str]) -> Iterator[None]:
    """Point the e2b SDK (which reads E2B_* from the environment) at a server, and
    put the environment back as it was afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def serving(node: Node) -> Iterator[Node]:
    """``node`` started with the e2b SDKs pointed at it, stopped afterwards, and
    nothing of it left behind."""
    node.start()
    try:
        with sdk_env(node.e2b_env()):
            yield node
    finally:
        node.stop()
    left = leaks(node.prefix, node.home)
    assert not left, f"node left behind: {left}"


def leaks(prefix: str, home: Path) -> list[str]:
    """Everything of a node's that should be gone after it stops."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {ln.split()[0]}" for ln in netns.splitlines()
              if ln.startswith(f"{prefix}-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for ln in links.splitlines():
        name = ln.split(":")[1].strip().split("@")[0]
        if name.startswith(f"{prefix}h"):
            found.append(f"link {name}")
    state = home / "run" / "runsc"
    if state.is_dir():
        out = subprocess.run(["runsc", f"--root={state}", "list", "-quiet"],
                             capture_output=True, text=True).stdout
        found += [f"runsc container {c}" for c in out.split()]
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob(f"*/{prefix}") if p.is_dir()]
    sandboxes = home / "run" / "sandboxes"
    if sandboxes.is_dir():
        found += [f"bundle dir {p.name}" for p in sandboxes.iterdir()]
    # Rootfs mounts of image templates (or anything else mounted in the home).
    prefix = str(home.resolve())
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {ln.split()[4]}" for ln in f
                  if ln.split()[4] == prefix or ln.split()[4].startswith(prefix + "/")]
    return found
