"""In-memory stand-ins for the runtime, the slot pool and envd, for orchestrator unit
tests that run in seconds. They keep the contracts of the real ones (runtime/base.py,
network.SlotPool, orchestrator.EnvdClient) and count what is held, so a test can assert
that nothing leaks; ``fail`` makes a named step raise, to test each rollback.

The real components are tested for real elsewhere (runsc, netns, envd in a sandbox);
these only make the orchestrator's own logic cheap to test exhaustively.
"""

from __future__ import annotations

import asyncio
import builtins
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..network import CompiledPolicy, Slot, SlotPoolExhausted
from ..orchestrator.envd_client import EnvdUnavailable, LayerRefused
from ..runtime import RuntimeFailure, RuntimeSandbox, SandboxSpec


class Faults:
    """Steps told to fail: ``fail("restore")`` makes the next restore raise."""

    def __init__(self) -> None:
        self.failing: dict[str, BaseException] = {}
        self.delays: dict[str, float] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.reached: dict[str, int] = {}  # how many times each step began

    def fail(self, step: str, exc: BaseException | None = None) -> None:
        self.failing[step] = exc or RuntimeError(f"injected failure at {step}")

    def delay(self, step: str, seconds: float) -> None:
        self.delays[step] = seconds

    def hold(self, step: str) -> asyncio.Event:
        """The step waits until the returned event is set (a kernel call that hangs)."""
        gate = self.gates[step] = asyncio.Event()
        return gate

    async def check(self, step: str) -> None:
        self.reached[step] = self.reached.get(step, 0) + 1
        if step in self.delays:
            await asyncio.sleep(self.delays[step])
        if step in self.gates:
            await self.gates[step].wait()
        exc = self.failing.pop(step, None)
        if exc is not None:
            raise exc


@dataclass
class FakeRuntime:
    """A runtime whose sandboxes are dictionary entries; checkpoints are small files."""

    faults: Faults = field(default_factory=Faults)
    kind: str = "fake"
    on_exit: Callable[[str, str], None] | None = None
    sandboxes: dict[str, RuntimeSandbox] = field(default_factory=dict)
    specs: dict[str, SandboxSpec] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    # What a checkpoint writes, and what capture_size() claims it will (runsc's own
    # estimate can be short of the truth).
    capture_bytes: int = 0
    estimated_capture_bytes: int = 0
    # Sandboxes frozen in place, and the CPU seconds each used (set by a test).
    frozen: set[str] = field(default_factory=set)
    cpu: dict[str, float] = field(default_factory=dict)
    # Frozen sandboxes whose memory was reclaimed since they last ran.
    reclaimed: set[str] = field(default_factory=set)
    reclaim_leaves: int = 2 << 20

    @property
    def version(self) -> str:
        return "0"

    async def _run(self, step: str, spec: SandboxSpec) -> RuntimeSandbox:
        self.calls.append((step, spec.sandbox_id))
        if spec.sandbox_id in self.sandboxes:
            raise RuntimeFailure(f"sandbox {spec.sandbox_id} exists already")
        # The engine holds the sandbox before it can fail (as runsc's state dir does).
        box = RuntimeSandbox(spec.sandbox_id, "created", 0)
        self.sandboxes[spec.sandbox_id] = box
        await self.faults.check(step)
        box = RuntimeSandbox(spec.sandbox_id, "running", 1000 + len(self.calls))
        self.sandboxes[spec.sandbox_id] = box
        self.specs[spec.sandbox_id] = spec
        return box

    async def start(self, spec: SandboxSpec) -> RuntimeSandbox:
        return await self._run("start", spec)

    def capture_size(self, sandbox_id: str) -> int:
        return self.estimated_capture_bytes

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> RuntimeSandbox:
        if not (image_dir / "checkpoint.img").is_file():
            raise RuntimeFailure(f"no checkpoint in {image_dir}")
        return await self._run("restore", spec)

    async def checkpoint(self, sandbox_id: str, image_dir: Path, leave_running: bool) -> None:
        self.calls.append(("checkpoint", sandbox_id))
        if sandbox_id not in self.sandboxes:
            raise RuntimeFailure(f"no sandbox {sandbox_id}")
        await self.faults.check("checkpoint")
        if self.sandboxes.get(sandbox_id, RuntimeSandbox("", "stopped", 0)).state == "stopped":
            raise RuntimeFailure(f"sandbox {sandbox_id} ended during its checkpoint")
        image_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(image_dir / "pages.img", "wb") as f:
                for _ in range(0, self.capture_bytes, 1 << 20):
                    f.write(bytes(1 << 20))
        except OSError as exc:
            # As gVisor's state encoder may: fail without naming the full disk.
            raise RuntimeFailure("checkpoint failed: runtime error: invalid memory "
                                 "address or nil pointer dereference") from exc
        (image_dir / "checkpoint.img").write_text(sandbox_id)
        if not leave_running:
            self.sandboxes[sandbox_id] = RuntimeSandbox(sandbox_id, "stopped", 0)

    async def destroy(self, sandbox_id: str) -> None:
        self.calls.append(("destroy", sandbox_id))
        await self.faults.check("destroy")
        self.frozen.discard(sandbox_id)
        self.sandboxes.pop(sandbox_id, None)
        self.specs.pop(sandbox_id, None)

    async def pause(self, sandbox_id: str) -> None:
        self.frozen.discard(sandbox_id)
        self.sandboxes[sandbox_id] = RuntimeSandbox(sandbox_id, "paused", 0)

    async def resume(self, sandbox_id: str) -> None:
        self.sandboxes[sandbox_id] = RuntimeSandbox(sandbox_id, "running", 0)

    def freeze(self, sandbox_id: str) -> bool:
        box = self.sandboxes.get(sandbox_id)
        if box is None or box.state != "running" or sandbox_id in self.frozen:
            return False
        self.frozen.add(sandbox_id)
        return True

    def thaw(self, sandbox_id: str) -> bool:
        if sandbox_id not in self.frozen:
            return False
        self.frozen.discard(sandbox_id)
        self.reclaimed.discard(sandbox_id)
        return True

    def frozen_count(self) -> int:
        return len(self.frozen)

    def is_frozen(self, sandbox_id: str) -> bool:
        return sandbox_id in self.frozen

    def reclaim(self, sandbox_id: str) -> tuple[int, int]:
        """As the driver: only a frozen sandbox, and each page once until it runs again;
        ``reclaim_leaves`` bytes stay resident (set by a test)."""
        self.calls.append(("reclaim", sandbox_id))
        if sandbox_id not in self.frozen or sandbox_id in self.reclaimed:
            return 0, self.reclaim_leaves
        self.reclaimed.add(sandbox_id)
        return 32 << 20, self.reclaim_leaves

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        return self.cpu.get(sandbox_id, 0.0) if sandbox_id in self.sandboxes else None

    def envd_dormant(self, sandbox_id: str) -> bool:
        return False

    async def state(self, sandbox_id: str) -> RuntimeSandbox | None:
        return self.sandboxes.get(sandbox_id)

    async def list(self) -> dict[str, RuntimeSandbox]:
        return dict(self.sandboxes)

    async def housekeeping(self) -> None:
        pass

    async def settle(self, wait_s: float) -> int:
        return 0

    async def reconcile(self, keep: set[str]) -> builtins.list[str]:
        gone = [sid for sid in self.sandboxes if sid not in keep]
        for sid in gone:
            del self.sandboxes[sid]
        return gone

    def crash(self, sandbox_id: str, why: str = "was killed: out of memory") -> None:
        """The sandbox's engine process ends on its own (as the host's OOM killer does)."""
        self.sandboxes[sandbox_id] = RuntimeSandbox(sandbox_id, "stopped", 0)
        if self.on_exit is not None:
            self.on_exit(sandbox_id, why)


@dataclass
class FakeSlots:
    """A slot pool of ``capacity`` slots with no network behind them."""

    capacity: int = 4
    faults: Faults = field(default_factory=Faults)
    holding: dict[int, Slot] = field(default_factory=dict)
    policies: dict[int, CompiledPolicy] = field(default_factory=dict)
    connections: dict[int, int] = field(default_factory=dict)  # outbound TCP held, per slot

    async def acquire(self, internet: bool = True) -> Slot:
        await self.faults.check("acquire")
        free = [i for i in range(2, 2 + self.capacity) if i not in self.holding]
        if not free:
            raise SlotPoolExhausted(f"all {self.capacity} slots are in use")
        index = free[0]
        slot = Slot(index=index, address=f"10.99.{index}.2", host_ip=f"10.99.{index}.1",
                    netns=f"fake{index}", netns_path=f"/run/netns/fake{index}",
                    router_netns=f"fake{index}r", host_link=f"fakeh{index}", internet=internet)
        self.holding[index] = slot
        return slot

    async def release(self, slot: Slot) -> None:
        if self.holding.get(slot.index) is not slot:
            raise RuntimeError(f"slot {slot.index} is not held by this caller")
        del self.holding[slot.index]
        self.policies.pop(slot.index, None)

    async def wait_change(self, seconds: float) -> None:
        await asyncio.sleep(min(seconds, 0.02))

    def expect(self, count: int) -> None:
        """A burst is announced (a fork): no slots to keep warm here."""

    async def reuse(self, slot: Slot) -> None:
        await self.faults.check("reuse")
        if self.holding.get(slot.index) is not slot:
            raise RuntimeError(f"slot {slot.index} is not held by this caller")

    async def apply_policy(self, slot: Slot, compiled: CompiledPolicy) -> None:
        await self.faults.check("egress")
        self.policies[slot.index] = compiled

    async def egress_by_address(self) -> Counter[str]:
        """As the pool's one read of the host's table: connections per slot address."""
        await self.faults.check("egress_read")
        return Counter({slot.address: self.connections.get(index, 0)
                        for index, slot in self.holding.items()})

    async def start(self, in_use: dict[int, bool] | None = None) -> None:
        """After a restart: the slots adopted sandboxes still hold stay held."""
        self.holding = {i: s for i, s in self.holding.items() if i in (in_use or {})}

    def held(self, index: int) -> Slot | None:
        return self.holding.get(index)

    async def close(self) -> None:
        self.holding.clear()


@dataclass
class FakeEnvd:
    """envd's host-side client, answering for every sandbox at once."""

    faults: Faults = field(default_factory=Faults)
    inits: dict[str, dict] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    disk_uploads: list[tuple[str, str, bytes]] = field(default_factory=list)
    # Each address's files layers (envd/layers.py), by tag, lowest first; and the calls.
    layers: dict[str, list[str]] = field(default_factory=dict)
    layer_calls: list[tuple[str, str]] = field(default_factory=list)

    async def close(self) -> None:
        pass

    async def layer(self, address: str, token: str, op: str, tag: str) -> dict:
        await self.faults.check(f"layer_{op}")
        self.layer_calls.append((op, tag))
        stack = self.layers.setdefault(address, [])
        if op == "push":
            stack.append(tag)
        elif tag in stack:
            del stack[len(stack) - stack[::-1].index(tag):]
        else:
            raise LayerRefused(f"no files layer for '{tag}' in this sandbox")
        return {"depth": len(stack), "killed": 0, "ms": 1.0}

    async def wait_ready(self, address: str, deadline_s: float = 15.0,
                         progress: Callable[[], float | None] | None = None) -> None:
        try:
            await self.faults.check("envd")
        except RuntimeError as exc:
            raise EnvdUnavailable(str(exc)) from exc

    async def init(self, address: str, access_token: str, env_vars: dict[str, str],
                   default_user: str = "user", current_token: str | None = None,
                   default_workdir: str = "", boot_id: str = "",
                   file_access: str = "") -> None:
        await self.faults.check("init")
        self.inits[address] = {"token": access_token, "env": dict(env_vars),
                               "user": default_user, "current": current_token,
                               "boot_id": boot_id, "file_access": file_access}

    async def start(self, address: str, token: str, command: str) -> None:
        await self.faults.check("start_command")
        self.commands.append(command)

    async def run(self, address: str, token: str, command: str, user: str = "root",
                  deadline_s: float = 60.0) -> int:
        self.commands.append(command)
        return 0

    async def disk_download(self, address: str, token: str, op: str, dest: Path,
                            limit: int, body: Path | None = None) -> int:
        """A sandbox whose only own file is /home/user/f (a filesystem-only capture)."""
        await self.faults.check(f"disk_{op}")
        data = (b'["/home/user/f", "f", 420, 1000, 1000, 3, 1, ""]\n' if op == "list"
                else b"an archive of /home/user/f")
        dest.write_bytes(data)
        return len(data)

    async def disk_upload(self, address: str, token: str, op: str, body: Path) -> dict:
        await self.faults.check(f"disk_{op}")
        self.disk_uploads.append((address, op, body.read_bytes()))
        return {}
