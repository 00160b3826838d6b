"""The one launch path, without runsc: every step's failure (and a cancellation at each
step) leaves nothing held, and each kind of plan runs the steps it should."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentenv.orchestrator import CapacityExceeded, OrchestratorError
from agentenv.orchestrator.launch import EnvdInit, Launcher, LaunchPlan
from agentenv.runtime import RuntimeFailure, SandboxSpec
from agentenv.templates import Template
from agentenv.testing.fakes import FakeEnvd, FakeRuntime, FakeSlots

TEMPLATE = Template("base", Path("/nonexistent/rootfs"), start_cmd="serve", ready_cmd="true")


class Rig:
    def __init__(self, capacity: int = 2) -> None:
        self.runtime = FakeRuntime()
        self.slots = FakeSlots(capacity)
        self.envd = FakeEnvd()
        self.rootfs_calls = 0
        self.launcher = Launcher(self.runtime, self.slots, self.envd, self._spec, self._rootfs)

    async def _rootfs(self, template: Template) -> None:
        self.rootfs_calls += 1
        await self.runtime.faults.check("rootfs")

    @staticmethod
    def _spec(plan: LaunchPlan, netns_path: str) -> SandboxSpec:
        return SandboxSpec(sandbox_id=plan.sandbox_id, rootfs=plan.template.rootfs,
                           hostname=f"sbx-{plan.hostname_of[:8]}", cpu_count=plan.cpu_count,
                           memory_mb=plan.memory_mb, netns_path=netns_path,
                           runtime_bundle=Path("/b"), bundle_mount="/.aenv", init_args=["envd"])

    def clean(self) -> bool:
        return not self.slots.holding and not self.runtime.sandboxes


def plan(sandbox_id: str = "sbx1", image: Path | None = None, **kw) -> LaunchPlan:
    return LaunchPlan(sandbox_id=sandbox_id, template=TEMPLATE, cpu_count=1, memory_mb=256,
                      hostname_of=sandbox_id, image=image, **kw)


async def test_boot_runs_every_step_and_hands_over_the_slot() -> None:
    rig = Rig()
    slot = await rig.launcher.launch(plan(init=EnvdInit("tok", {"A": "1"}), start_command=True,
                                          network={"deny_out": ["0.0.0.0/0"]}))
    assert rig.slots.holding == {slot.index: slot}
    assert rig.runtime.sandboxes["sbx1"].state == "running"
    assert rig.envd.inits[slot.address]["env"] == {"A": "1"}
    assert rig.envd.commands == ["serve", "true"]
    assert slot.index in rig.slots.policies  # the egress policy is in force
    assert rig.runtime.specs["sbx1"].netns_path == slot.netns_path


async def test_restore_without_init_leaves_envd_alone(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.img").write_text("x")
    rig = Rig()
    await rig.launcher.launch(plan(image=tmp_path))
    assert rig.runtime.calls == [("restore", "sbx1")]
    assert rig.envd.inits == {} and rig.envd.commands == []


@pytest.mark.parametrize("step", ["rootfs", "acquire", "egress", "start", "envd", "init",
                                  "start_command"])
async def test_a_failure_at_any_step_leaves_nothing_held(step: str) -> None:
    rig = Rig()
    faults = {"rootfs": rig.runtime.faults, "acquire": rig.slots.faults,
              "egress": rig.slots.faults, "start": rig.runtime.faults,
              "envd": rig.envd.faults, "init": rig.envd.faults,
              "start_command": rig.envd.faults}[step]
    faults.fail(step, RuntimeFailure(f"boom at {step}") if step == "start" else None)
    with pytest.raises((OrchestratorError, RuntimeError)) as err:
        await rig.launcher.launch(plan(init=EnvdInit("tok"), start_command=True,
                                       internet=False))
    assert rig.clean(), (step, rig.slots.holding, rig.runtime.sandboxes)
    if step in ("start", "envd"):  # the engine's and envd's failures read as the launch's
        assert isinstance(err.value, OrchestratorError)
        assert str(err.value).startswith("sandbox failed to start")
    # The pool is usable again at once.
    await rig.launcher.launch(plan("sbx2"))


@pytest.mark.parametrize("step", ["acquire", "egress", "start", "envd", "init"])
async def test_cancelled_at_any_step_leaves_nothing_held(step: str) -> None:
    rig = Rig()
    for faults in (rig.runtime.faults, rig.slots.faults, rig.envd.faults):
        faults.delay(step, 5)
    task = asyncio.create_task(rig.launcher.launch(plan(init=EnvdInit("tok"),
                                                        internet=False)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rig.clean(), (step, rig.slots.holding, rig.runtime.sandboxes)


async def test_no_slot_free_is_capacity_and_takes_nothing() -> None:
    rig = Rig(capacity=1)
    await rig.launcher.launch(plan("a"))
    with pytest.raises(CapacityExceeded):
        await rig.launcher.launch(plan("b"))
    assert list(rig.runtime.sandboxes) == ["a"] and len(rig.slots.holding) == 1


async def test_a_missing_checkpoint_is_a_restore_failure(tmp_path: Path) -> None:
    rig = Rig()
    with pytest.raises(OrchestratorError, match="sandbox failed to restore"):
        await rig.launcher.launch(plan(image=tmp_path / "gone"))
    assert rig.clean()
