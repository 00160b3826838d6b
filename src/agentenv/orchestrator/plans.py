"""What the node's configuration and templates make of a request or a record: its
timeout and resources within the node's bounds, the template it launches from, what
envd is told, and the launch plan itself."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..network import Slot
from ..resources import CPU, DISK, MEMORY, ResourceLimits
from ..templates import Template, TemplateNotFound, TemplateRegistry
from .launch import EnvdInit, LaunchPlan
from .models import BadRequest, NotFound, SandboxRecord
from .records import Resources
from .requests import check_timeout


@dataclass(eq=False, repr=False)
class Plans:
    config: Config
    templates: TemplateRegistry
    limits: ResourceLimits

    def timeout(self, timeout: int | None) -> int:
        return check_timeout(timeout, self.config.default_timeout, self.config.max_timeout)

    def resources(self, cpu_count: Any, memory_mb: Any, disk_size_mb: Any) -> Resources:
        """Resources within the node's bounds (values from disk are never trusted)."""
        return Resources(self.limits.clamp(CPU, cpu_count, 1),
                         self.limits.clamp(MEMORY, memory_mb, 512),
                         self.limits.clamp(DISK, disk_size_mb, 0))

    def template_of(self, record: SandboxRecord, gone: str = "template of the sandbox is gone"
                    ) -> Template:
        try:
            return self.templates.get(record.template_id)
        except TemplateNotFound as exc:
            raise NotFound(f"{gone}: {exc}") from exc

    def bootable_template(self, record: SandboxRecord) -> Template:
        template = self.template_of(record)
        if template.snapshot_id:
            raise BadRequest(f"template '{template.template_id}' was built from steps: its "
                             "files live in its memory snapshot, so a filesystem-only pause "
                             "cannot reboot it; pause with memory")
        return template

    def plan(self, record: SandboxRecord, template: Template, *, hostname_of: str,
             image: Path | None = None, current_token: str = "", init: bool = True,
             start_command: bool = False, purpose: str = "", files: Path | None = None,
             new_boot: bool = False, slot: Slot | None = None) -> LaunchPlan:
        return LaunchPlan(
            sandbox_id=record.sandbox_id, template=template, cpu_count=record.cpu_count,
            memory_mb=record.memory_mb, hostname_of=hostname_of, image=image,
            internet=record.internet, network=record.network,
            init=self.envd_init(record, template, current_token, new_boot) if init else None,
            files=files, start_command=start_command, purpose=purpose, slot=slot,
            on_started=lambda: setattr(record, "booted_at", time.time()))

    def envd_init(self, record: SandboxRecord, template: Template, current_token: str = "",
                  new_boot: bool = False) -> EnvdInit:
        """What envd is told for this record: its token, env vars, the template's user
        and file access, and for a new boot (a create, not a fork or a resume) a boot
        ID of its own."""
        return EnvdInit(record.envd_token, record.env_vars,
                        default_user=template.default_user or "user",
                        default_workdir=template.default_workdir, current_token=current_token,
                        boot_id=str(uuid.uuid4()) if new_boot else "",
                        file_access=self.file_access(template))

    def file_access(self, template: Template) -> str:
        """envd's file access for ``template``'s sandboxes: its own, else the node's."""
        return template.file_access or self.config.envd_file_access
