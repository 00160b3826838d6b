"""The runtime spec of a sandbox, and what a snapshot must share with this node to be
restored here.

A restore must see exactly what was checkpointed: the same envd bundle, runtime and
spec shape. Every snapshot's metadata is stamped with them (``stamp``) and checked
before a restore (``check_restorable``), so a mismatch is a clear 409 instead of a
restore that fails (or worse, half works).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from ..config import Config
from ..envd.bundle import build_bundle, envd_command
from ..envd.dormancy import AFTER_ENV
from ..envd.protocol import ENVD_PORT
from ..resources import CPU, DISK, MEMORY, ResourceLimits
from ..runtime import Runtime, SandboxSpec
from ..runtime.oci import files_quota_mb
from ..templates import Template
from .launch import LaunchPlan
from .models import Conflict

BUNDLE_MOUNT = "/.aenv"
# Bumped whenever the spec's shape changes what a checkpoint depends on (mounts,
# devices): 2 = /tmp is a sized tmpfs. Snapshots of another shape are refused.
SPEC_VERSION = 2


class SpecFactory:
    def __init__(self, config: Config, runtime: Runtime, limits: ResourceLimits) -> None:
        self.config = config
        self.runtime = runtime
        self.limits = limits
        self.bundle: Path | None = None
        self._init_argv: list[str] = []
        self._init_env: dict[str, str] = {}

    async def prepare(self) -> None:
        """Build (or find) envd's runtime bundle: once per node start, off the loop."""
        self.bundle = await asyncio.to_thread(build_bundle, self.config.bundles_dir)
        self._init_argv, self._init_env = envd_command(BUNDLE_MOUNT, ENVD_PORT)
        self._init_env[AFTER_ENV] = f"{self.config.envd_dormant_after_s:g}"

    @property
    def bundle_name(self) -> str:
        return self.bundle.name if self.bundle else ""

    def __call__(self, plan: LaunchPlan, netns_path: str) -> SandboxSpec:
        """The spec of the plan's sandbox (the same for boot and restore)."""
        assert self.bundle is not None, "prepare() first"
        template = plan.template
        disk_mb, cpu_count, memory_mb = self._resources(template, plan.cpu_count,
                                                        plan.memory_mb)
        return SandboxSpec(
            sandbox_id=plan.sandbox_id,
            rootfs=template.rootfs,
            hostname=f"sbx-{plan.hostname_of[:8]}",
            cpu_count=cpu_count,
            memory_mb=memory_mb,
            netns_path=netns_path,
            runtime_bundle=self.bundle,
            bundle_mount=BUNDLE_MOUNT,
            init_args=self._init_argv,
            init_env=self._envd_env(disk_mb, memory_mb),
            disk_mb=disk_mb,
        )

    def _resources(self, template: Template, cpu_count: int, memory_mb: int
                   ) -> tuple[int, int, int]:
        """Disk, CPUs and memory the runtime is given: the last word, whatever a record
        says."""
        disk_mb = self.limits.clamp(DISK, template.disk_size_mb or self.config.default_disk_mb,
                                    1024)
        return (disk_mb, self.limits.clamp(CPU, cpu_count, 1),
                self.limits.clamp(MEMORY, memory_mb, 512))

    def _envd_env(self, disk_mb: int, memory_mb: int) -> dict[str, str]:
        return {**self._init_env, "AENV_MEMORY_LIMIT_MB": str(memory_mb),
                # envd's guard keeps / and /tmp together within the writable
                # budget (runsc has no size limit for the in-memory root layer).
                "AENV_DISK_LIMIT_MB": str(files_quota_mb(disk_mb, memory_mb))}

    def image_stamp(self, template: Template) -> str:
        """What a template's boot image takes from this node beyond the template and the
        bundle: envd's command line and environment as it started (its dormancy, its
        memory and disk guards: a restored envd keeps them) and the resources it was
        given. Nodes that differ here must not restore each other's images."""
        disk_mb, cpu_count, memory_mb = self._resources(template, template.cpu_count,
                                                        template.memory_mb)
        return json.dumps([self._init_argv, sorted(self._envd_env(disk_mb, memory_mb).items()),
                           disk_mb, cpu_count])

    def stamp(self) -> dict:
        """What a snapshot taken here depends on, for its metadata."""
        return {"runtime": {"kind": self.runtime.kind, "version": self.runtime.version},
                "bundle": self.bundle_name, "spec": SPEC_VERSION}

    def check_restorable(self, metadata: dict) -> None:
        runtime = metadata.get("runtime", {})
        if runtime.get("kind") != self.runtime.kind or runtime.get("version") != \
                self.runtime.version:
            raise Conflict(
                f"snapshot was taken by runtime {runtime.get('kind')} {runtime.get('version')}; "
                f"this node runs {self.runtime.kind} {self.runtime.version}")
        if self.bundle is not None and metadata.get("bundle") not in ("", self.bundle.name):
            raise Conflict(f"snapshot needs envd bundle {metadata.get('bundle')}, this node has "
                           f"{self.bundle.name}")
        if int(metadata.get("spec") or 1) != SPEC_VERSION:
            raise Conflict(f"snapshot was taken with sandbox spec version "
                           f"{metadata.get('spec') or 1}; this node runs version {SPEC_VERSION} "
                           "(recreate the snapshot or template on this node)")
