"""Slow and oversized clients: a node keeps serving everyone else.

Hundreds of connections trickle a request head a few bytes at a time
(slowloris), dozens trickle a request body, while a normal client lists,
checks health and creates a sandbox: its requests stay quick. The server
closes the trickling heads once their deadline passes and answers the slow
bodies with a 408; oversized bodies get a 413 before they are sent whole.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest

from agentenv.testing import Node, leaks

PREFIX = "asl"
CIDR = "10.43.0.0/16"
HEAD_TIMEOUT = 3
BODY_TIMEOUT = 4
SLOW_HEADS = 400
SLOW_BODIES = 40


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    server = Node(tmp_path_factory.mktemp("slow") / "home", PREFIX, CIDR,
                  AENV_HTTP_HEAD_TIMEOUT=str(HEAD_TIMEOUT),
                  AENV_HTTP_BODY_TIMEOUT=str(BODY_TIMEOUT))
    server.start()
    yield server
    code = server.stop()
    assert code in (0, -15), server.log_tail()
    assert leaks(PREFIX, server.home) == []


async def _trickle_head(port: int, stop: asyncio.Event) -> float | None:
    """Send a request head a line at a time, never finishing it; how long until
    the server closed the connection (None: it never did before ``stop``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: node\r\n")
        await writer.drain()
        n = 0
        while not stop.is_set():
            try:
                closed = await asyncio.wait_for(reader.read(1024), 0.5) == b""
            except TimeoutError:
                closed = False
            except ConnectionError:
                # Closed with a trickled line unread in the server's buffer: a reset.
                closed = True
            if closed:
                return time.monotonic() - t0
            writer.write(f"X-Trickle-{n}: {n}\r\n".encode())
            n += 1
            try:
                await writer.drain()
            except ConnectionError:
                return time.monotonic() - t0
        return None
    finally:
        writer.close()


async def _trickle_body(port: int, key: str) -> tuple[int, float]:
    """Announce a 2 KiB JSON body and send it a byte at a time; the status the
    server answers with and when."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    try:
        writer.write(b"POST /sandboxes HTTP/1.1\r\nHost: node\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 2048\r\nX-API-Key: " + key.encode() + b"\r\n\r\n")
        await writer.drain()
        read = asyncio.ensure_future(reader.readline())
        while not read.done():
            writer.write(b" ")
            try:
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.wait([read], timeout=0.3)
        status_line = await asyncio.wait_for(read, 5)
        return int(status_line.split()[1]), time.monotonic() - t0
    finally:
        writer.close()


async def _normal_client(node: Node, seconds: float) -> list[float]:
    """Health and list requests back to back; each one's latency."""
    latencies = []
    headers = {"X-API-Key": node.api_key}
    async with httpx.AsyncClient(base_url=node.url, headers=headers, timeout=10) as api:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for path in ("/health", "/sandboxes"):
                t0 = time.perf_counter()
                r = await api.get(path)
                latencies.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
            await asyncio.sleep(0.05)
    return latencies


async def _baseline(node: Node) -> float:
    return statistics.median(await _normal_client(node, 2))


# Its figures are compared with unloaded ones: run alone (make test). The others only
# wait on the node's deadlines, so they run in the parallel part.
@pytest.mark.serial
def test_slow_clients_do_not_starve_others(node: Node) -> None:
    async def run() -> None:
        quiet = await _baseline(node)
        stop = asyncio.Event()
        heads = [asyncio.create_task(_trickle_head(node.port, stop)) for _ in range(SLOW_HEADS)]
        bodies = [asyncio.create_task(_trickle_body(node.port, node.api_key))
                  for _ in range(SLOW_BODIES)]
        await asyncio.sleep(0.5)  # all of them connected and trickling
        busy = await _normal_client(node, 2 * BODY_TIMEOUT)
        # A real sandbox can still be created and used meanwhile.
        async with httpx.AsyncClient(base_url=node.url, headers={"X-API-Key": node.api_key},
                                     timeout=120) as api:
            r = await api.post("/sandboxes", json={"templateID": "base"})
            assert r.status_code == 201, r.text
            assert (await api.delete(f"/sandboxes/{r.json()['sandboxID']}")).status_code == 204
        stop.set()
        closed_after = await asyncio.gather(*heads)
        answered = await asyncio.gather(*bodies)

        print(f"normal client: median {quiet * 1000:.1f} ms alone, "
              f"{statistics.median(busy) * 1000:.1f} ms (max {max(busy) * 1000:.0f} ms) "
              f"beside {SLOW_HEADS} slow heads and {SLOW_BODIES} slow bodies")
        # Nobody waits behind the slow clients: every request answered well
        # under a second (the machine is noisy), the median barely moved.
        assert max(busy) < 1.0
        assert statistics.median(busy) < max(0.1, 10 * quiet)
        # Every trickled head was cut off at its deadline, not left open.
        assert all(t is not None for t in closed_after), \
            f"{sum(t is None for t in closed_after)} slow heads were never closed"
        assert max(closed_after) < HEAD_TIMEOUT + 3
        assert min(closed_after) >= HEAD_TIMEOUT - 0.5
        # Every trickled body got a 408 once its deadline passed.
        assert {status for status, _ in answered} == {408}
        assert all(BODY_TIMEOUT - 0.5 <= t < BODY_TIMEOUT + 3 for _, t in answered), answered

    asyncio.run(run())
    assert httpx.get(node.url + "/health").status_code == 200


def test_slow_body_answer_is_the_error_shape(node: Node) -> None:
    """The 408 is a JSON error like every other, and the connection is closed."""
    async def run() -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
        writer.write(b"POST /sandboxes HTTP/1.1\r\nHost: node\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 100\r\nX-API-Key: " + node.api_key.encode()
                     + b"\r\n\r\n{")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BODY_TIMEOUT + 5)
        body = await asyncio.wait_for(reader.read(), 10)  # until the server closes
        writer.close()
        return head, body

    head, body = asyncio.run(run())
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body) == {"code": 408, "message":
                                f"request body not received within {BODY_TIMEOUT} seconds"}


def test_oversized_bodies_are_refused_before_they_are_read(node: Node) -> None:
    """A declared 100 MiB body is refused at once, with none of it sent; a chunked
    body without a length is cut off once it passes 1 MiB."""
    async def declared() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
        writer.write(b"POST /sandboxes HTTP/1.1\r\nHost: node\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 104857600\r\nX-API-Key: " + node.api_key.encode()
                     + b"\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        return head

    t0 = time.monotonic()
    assert asyncio.run(declared()).startswith(b"HTTP/1.1 413")
    assert time.monotonic() - t0 < 3

    sent = 0

    def chunks():
        nonlocal sent
        yield b'{"templateID": "base", "metadata": {"blob": "'
        for _ in range(64):  # 64 MiB if the server read it all
            sent += 1 << 20
            yield b"x" * (1 << 20)
        yield b'"}}'

    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key},
                      timeout=30) as api:
        try:
            r = api.post("/sandboxes", content=chunks(),
                         headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["code"] == 413
        except httpx.TransportError:
            pass  # the server answered 413 and closed while we were still sending
    assert sent < 64 << 20, "the server read a 64 MiB body to its end"
    assert httpx.get(node.url + "/health").status_code == 200


def test_a_kept_alive_connection_serves_the_request_after_a_think_gap(node: Node) -> None:
    """An agent's next request comes after a gap longer than the head deadline (and
    uvicorn's 5 s keep-alive): it is served on the connection its client pooled, not
    lost to a close racing it (the e2b SDK keeps idle connections 300 s). A head
    begun after the gap still gets only the head deadline."""
    import socket

    def get(sock: socket.socket) -> bytes:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: node\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < \
                int(answer.lower().partition(b"content-length:")[2].split(b"\r\n")[0] or 0):
            chunk = sock.recv(4096)
            assert chunk, f"closed by the server after {answer!r}"
            answer += chunk
        return answer

    with socket.create_connection(("127.0.0.1", node.port), timeout=30) as sock:
        assert get(sock).startswith(b"HTTP/1.1 200")
        time.sleep(max(HEAD_TIMEOUT, 5) + 1.5)  # the think gap
        assert get(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HEAD_TIMEOUT + 1)
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # a head begun, never finished
        t0 = time.monotonic()
        assert sock.recv(1024) == b""
        assert time.monotonic() - t0 < HEAD_TIMEOUT + 3
