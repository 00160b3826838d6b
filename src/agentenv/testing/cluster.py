"""A real cluster on one machine for tests and benchmarks: redis-server, `aenv
scheduler`, `aenv gateway` and node servers, each node in its own network
namespace with its own address, AENV_HOME, slot prefix and address pool, all
sharing one posix_fs snapshot repository and one API key.

Topology: node k lives in netns ``<ns>k`` and reaches the root netns over a veth
pair, root side ``<link>k`` 10.<link_net>.k.1/24, node side ``up0`` .2/24. The
scheduler listens on every address, so nodes reach it at their link's .1; the
gateway (root netns) reaches node k at .2. Cutting node k's link is ``ip link
set <link>k down``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from .nodes import AENV, Node, leaks, sdk_env
from .ports import listening_socket, start_redis

NODE_PORT = 8000
# The front of several gateways, as deployed.
FRONT_CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "haproxy.cfg"
SENTINEL_NAME = "aenv"
# The gateway's and scheduler's request-head deadline (short, so a test can see it act).
SERVICE_HEAD_TIMEOUT = 4


def _ip(*args: str, netns: str | None = None, check: bool = True) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(argv, check=check, capture_output=True)


def _wait_http(url: str, proc: subprocess.Popen, log: Path, wait: float = 30) -> None:
    end = time.monotonic() + wait
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen | None, timeout: float = 20) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ClusterNode(Node):
    """A node server inside netns ``netns`` listening on ``address``."""

    def __init__(self, home: Path, prefix: str, cidr: str, netns: str, address: str, **env: str):
        super().__init__(home, prefix, cidr, **env)
        self._release_port()  # it listens on its own netns's address
        self.netns = netns
        self.address = address
        self.port = NODE_PORT

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def start(self, wait: float = 90) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # Only the network namespace changes; the node sees the host's mounts.
        self.proc = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{self.netns}", str(AENV), "server",
             "--host", self.address, "--port", str(self.port)],
            env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,
        )
        log.close()
        _wait_http(self.url + "/health", self.proc, self.log_path, wait)

    def leaks(self) -> list[str]:
        """What the node left behind, its host-side links looked for in its own netns."""
        found = leaks(self.prefix, self.home)
        out = subprocess.run(["ip", "-n", self.netns, "-o", "link", "show"],
                             capture_output=True, text=True).stdout
        for ln in out.splitlines():
            name = ln.split(":")[1].strip().split("@")[0]
            if name.startswith(f"{self.prefix}h"):
                found.append(f"link {name} (in {self.netns})")
        return found


class Cluster:
    def __init__(self, root: Path, tag: str, nodes: int = 3, link_net: int = 23,
                 pool_nets: tuple[int, ...] = (33, 34, 35), max_sandboxes: int = 3,
                 heartbeat_ms: int = 300, node_ttl_ms: int = 1500,
                 gateway_queue_s: float = 30.0, schedulers: int = 1, sentinel: bool = False,
                 gateways: int = 1, front: bool = False, **node_env: str):
        self.root = root
        self.tag = tag
        self.count = nodes
        self.link_net = link_net
        self.pool_nets = pool_nets
        self.max_sandboxes = max_sandboxes
        self.heartbeat_ms = heartbeat_ms
        self.node_ttl_ms = node_ttl_ms
        # How long the gateway waits for a node with room before a 429.
        self.gateway_queue_s = gateway_queue_s
        self.node_env = node_env
        self.home = root / "cluster-home"
        self.repo = root / "repository"
        # The services' ports are bound here and their sockets handed to them at start
        # (agentenv.testing.ports); redis-server's ports are known once it has started.
        self.redis_port = 0
        # Several schedulers (stateless over Redis): the gateway and nodes try each.
        self._scheduler_socks = [listening_socket("0.0.0.0") for _ in range(schedulers)]
        self.scheduler_ports = [s.getsockname()[1] for s in self._scheduler_socks]
        self.scheduler_port = self.scheduler_ports[0]
        self.schedulers: list[subprocess.Popen] = []
        # Several gateways (stateless over Redis); with front, HAProxy over them
        # (deploy/haproxy.cfg) is what gateway_url names.
        self._gateway_socks = [listening_socket() for _ in range(gateways)]
        self.gateway_ports = [s.getsockname()[1] for s in self._gateway_socks]
        self.gateway_port = self.gateway_ports[0]
        self.gateways: list[subprocess.Popen] = []
        self.front = front
        self._front_sock = listening_socket() if front else None
        self.front_port = self._front_sock.getsockname()[1] if self._front_sock else 0
        self.front_proc: subprocess.Popen | None = None
        self.redis: subprocess.Popen | None = None
        # With sentinel: a replica of it and one Sentinel (quorum 1) watching it.
        self.sentinel = sentinel
        self.replica_port = 0
        self.sentinel_port = 0
        self.replica: subprocess.Popen | None = None
        self.sentinel_proc: subprocess.Popen | None = None
        self.scheduler: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.nodes: list[ClusterNode] = []
        self.api_key = "aenv_cluster_" + os.urandom(16).hex()

    # -- names ------------------------------------------------------------------------
    def netns(self, k: int) -> str:
        return f"xcn{self.tag}{k}"

    def link(self, k: int) -> str:
        return f"xcv{self.tag}{k}"

    def node_address(self, k: int) -> str:
        return f"10.{self.link_net}.{k}.2"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.front_port if self.front else self.gateway_port}"

    def gateway_urls(self) -> list[str]:
        """Every gateway's own URL (not the front's)."""
        return [f"http://127.0.0.1:{p}" for p in self.gateway_ports]

    @property
    def scheduler_url(self) -> str:
        return f"http://127.0.0.1:{self.scheduler_port}"

    @property
    def redis_url(self) -> str:
        if self.sentinel:
            return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SENTINEL_NAME}"
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def redis_primary(self) -> int:
        """The port of the Redis primary now (Sentinel's answer, with sentinel)."""
        if not self.sentinel:
            return self.redis_port
        out = subprocess.run(["redis-cli", "-p", str(self.sentinel_port), "sentinel",
                              "get-master-addr-by-name", SENTINEL_NAME],
                             capture_output=True, text=True).stdout.split()
        return int(out[-1]) if out else 0

    def _redis(self, name: str, *args: str) -> tuple[subprocess.Popen, int]:
        return start_redis(lambda port: [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.root), *args],  # a replica's sync file
            self.root / f"{name}.log")

    def _sentinel(self) -> tuple[subprocess.Popen, int]:
        conf = self.root / "sentinel.conf"

        def argv(port: int) -> list[str]:
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
                f"sentinel monitor {SENTINEL_NAME} 127.0.0.1 {self.redis_port} 1\n"
                f"sentinel down-after-milliseconds {SENTINEL_NAME} 1000\n"
                f"sentinel failover-timeout {SENTINEL_NAME} 5000\n")
            return ["redis-server", str(conf), "--sentinel"]

        return start_redis(argv, self.root / "sentinel.log")

    def e2b_env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.gateway_url, "E2B_SANDBOX_URL": self.gateway_url,
                "E2B_API_KEY": self.api_key}

    def client(self, url: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=url or self.gateway_url, timeout=120, trust_env=False,
                            headers={"X-API-Key": self.api_key})

    def owner(self, sandbox_id: str) -> str:
        """The node Redis names as the sandbox's owner (asked of the first scheduler)."""
        with self.client(self.scheduler_url) as c:
            return str(c.get(f"/sandboxes/{sandbox_id}").json()["node"])

    # -- start / stop -------------------------------------------------------------------
    def _write_key(self, home: Path) -> None:
        secrets = home / "secrets"
        secrets.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = secrets / "api-key"
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.api_key + "\n")

    def _service(self, name: str, argv: list[str], sock: socket.socket) -> subprocess.Popen:
        """``aenv <argv>`` serving on ``sock`` (handed over: closed here once started)."""
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/health"
        argv = [*argv, "--port", str(sock.getsockname()[1]), "--fd", str(sock.fileno())]
        log_path = self.root / f"{name}.log"
        log = open(log_path, "ab")
        env = {**os.environ, "AENV_HOME": str(self.home),
               "AENV_REDIS_URL": self.redis_url,
               "AENV_NODE_TTL_MS": str(self.node_ttl_ms),
               "AENV_HTTP_HEAD_TIMEOUT": str(SERVICE_HEAD_TIMEOUT),
               "AENV_ADMISSION_QUEUE_TIMEOUT_S": str(self.gateway_queue_s),
               "AENV_EXIT_WITH_PARENT": str(os.getpid())}
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=log, start_new_session=True,
                                    pass_fds=(sock.fileno(),))
        finally:
            sock.close()  # the service's now: a killed one's port refuses connections
            log.close()
        _wait_http(url, proc, log_path)
        return proc

    @contextlib.contextmanager
    def serving(self, warm: bool = False) -> Iterator[Cluster]:
        """Started (each node holding ``base``'s image when ``warm``) with the e2b SDKs
        pointed at the gateway; stopped afterwards, nothing of it left behind."""
        try:
            self.start()
            if warm:
                self.warm()
            with sdk_env(self.e2b_env()):
                yield self
        finally:
            left = self.stop()
        assert not left, f"cluster left behind: {left}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.repo.mkdir(exist_ok=True)
        self._write_key(self.home)
        self.redis, self.redis_port = self._redis("redis")
        if self.sentinel:
            self.replica, self.replica_port = self._redis(
                "replica", "--replicaof", "127.0.0.1", str(self.redis_port))
            self.sentinel_proc, self.sentinel_port = self._sentinel()
        socks, self._scheduler_socks = self._scheduler_socks, []
        for i, sock in enumerate(socks):
            self.schedulers.append(self._service(
                f"scheduler{i or ''}", [str(AENV), "scheduler", "--host", "0.0.0.0"], sock))
        self.scheduler = self.schedulers[0]
        urls = ",".join(f"http://127.0.0.1:{p}" for p in self.scheduler_ports)
        socks, self._gateway_socks = self._gateway_socks, []
        for i, sock in enumerate(socks):
            self.gateways.append(self._service(
                f"gateway{i or ''}", [str(AENV), "gateway", "--scheduler-url", urls], sock))
        self.gateway = self.gateways[0]
        if self.front:
            self._start_front()
        for k in range(1, self.count + 1):
            self.add_node(k)
        self.wait_nodes_up(list(range(1, self.count + 1)))

    def _start_front(self) -> None:
        """HAProxy with the deployment's own config (deploy/haproxy.cfg) over the
        first two gateways."""
        log_path = self.root / "front.log"
        log = open(log_path, "ab")
        sock, self._front_sock = self._front_sock, None
        assert sock is not None
        # HAProxy serves on the socket handed to it (`bind fd@N`).
        env = {**os.environ, "AENV_FRONT_BIND": f"fd@{sock.fileno()}",
               **{f"AENV_GATEWAY{i}": f"127.0.0.1:{p}"
                  for i, p in enumerate(self.gateway_ports[:2], 1)}}
        try:
            self.front_proc = subprocess.Popen(
                ["haproxy", "-db", "-f", str(FRONT_CONFIG)], env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, start_new_session=True, pass_fds=(sock.fileno(),))
        finally:
            sock.close()
            log.close()
        _wait_http(self.gateway_url + "/health", self.front_proc, log_path)

    def add_node(self, k: int) -> ClusterNode:
        ns, link = self.netns(k), self.link(k)
        _ip("link", "del", link, check=False)  # leftovers of a crashed run, ours by name
        _ip("netns", "del", ns, check=False)
        try:  # a half-made node's netns and link go at once (stop() knows only nodes)
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", "up0", "netns", ns)
            _ip("addr", "add", f"10.{self.link_net}.{k}.1/24", "dev", link)
            _ip("link", "set", link, "up")
            _ip("link", "set", "lo", "up", netns=ns)
            _ip("addr", "add", f"{self.node_address(k)}/24", "dev", "up0", netns=ns)
            _ip("link", "set", "up0", "up", netns=ns)
            # Peers reach each other through the root netns (it forwards).
            _ip("route", "add", f"10.{self.link_net}.0.0/16", "via", f"10.{self.link_net}.{k}.1",
                netns=ns)
            home = self.root / f"node{k}"
            self._write_key(home)
            node = ClusterNode(
                home, f"xc{self.tag}n{k}", f"10.{self.pool_nets[k - 1]}.0.0/16", ns,
                self.node_address(k),
                AENV_NODE_ID=f"node-{k}", AENV_SNAPSHOT_PATH=str(self.repo),
                AENV_SCHEDULER_URL=",".join(f"http://10.{self.link_net}.{k}.1:{p}"
                                            for p in self.scheduler_ports),
                AENV_HEARTBEAT_INTERVAL_MS=str(self.heartbeat_ms),
                AENV_MAX_SANDBOXES=str(self.max_sandboxes),
                AENV_NET_POOL_LOW="1", AENV_NET_POOL_HIGH="2", **self.node_env,
            )
        except BaseException:
            _ip("link", "del", link, check=False)
            _ip("netns", "del", ns, check=False)
            raise
        self.nodes.append(node)  # first: stop() removes its netns even if it fails to start
        node.start()
        return node

    def warm(self, template: str = "base", wait: float = 120) -> None:
        """Creates on each node until it reports the template's image cached (building
        an image takes a slot, which would skew capacity and placement)."""
        end = time.monotonic() + wait
        with self.client(self.scheduler_url) as sched:
            for k, node in enumerate(self.nodes, 1):
                with self.client(node.url) as c:
                    while template not in sched.get(f"/nodes/node-{k}").json()["templates"]:
                        if time.monotonic() > end:
                            raise RuntimeError(f"node-{k} did not cache template {template}")
                        r = c.post("/sandboxes", json={"templateID": template, "timeout": 60})
                        r.raise_for_status()
                        c.delete(f"/sandboxes/{r.json()['sandboxID']}")
                        time.sleep(self.heartbeat_ms / 1000 * 2)

    def node(self, node_id: str) -> ClusterNode:
        return self.nodes[int(node_id.rsplit("-", 1)[1]) - 1]

    def states(self) -> dict[str, str]:
        with self.client(self.scheduler_url) as c:
            return {n["node_id"]: n["state"] for n in c.get("/nodes").json()}

    def wait_state(self, k: int, state: str, wait: float = 20) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait:
            if self.states().get(f"node-{k}") == state:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"node-{k} is not {state} after {wait}s: {self.states()}")

    def wait_nodes_up(self, ks: list[int], wait: float = 90) -> None:
        for k in ks:
            self.wait_state(k, "up", wait)

    def cut_link(self, k: int) -> None:
        _ip("link", "set", self.link(k), "down")

    def restore_link(self, k: int) -> None:
        _ip("link", "set", self.link(k), "up")

    def stop(self) -> list[str]:
        """Stop everything; what any node leaked (a killed node is restarted first,
        so that it cleans up after itself as after any crash)."""
        left: list[str] = []
        for node in self.nodes:
            try:
                if node.proc is not None and node.proc.poll() is not None and \
                        node.proc.returncode == -signal.SIGKILL:
                    node.start()
                node.stop()
            except Exception as exc:  # keep stopping the rest
                left.append(f"node {node.netns}: {exc}")
            left += node.leaks()
        for proc in (self.front_proc, *self.gateways, *self.schedulers, self.sentinel_proc,
                     self.replica, self.redis):
            _stop(proc)
        for k in range(1, len(self.nodes) + 1):
            _ip("link", "del", self.link(k), check=False)
            _ip("netns", "del", self.netns(k), check=False)
        return left
