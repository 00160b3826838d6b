"""Creates straight from an image reference: the image as a template of its own
(pulled on first use), and optionally a setup command run once per (image digest,
setup command) and kept as a built template whose snapshot later creates restore.

Names (all valid template IDs, so a sandbox's ``templateID`` says where it came from):

- ``img-<16 hex>``: the image, hashed from the reference as given (a build's
  ``fromImage`` uses the same name, so both share one template); with credentials
  the hash is keyed by a node secret and covers them, so an anonymous create never
  reuses an image another caller pulled with credentials;
- ``setup-<16 hex of the manifest digest>-<16 hex of the command>``.

As ``docker run`` (pull policy "if not present"), a reference already pulled is not
resolved again: pin a digest (``repo@sha256:...``) to get exactly one image.

Concurrent first creates of one image share one pull, and of one (image, setup)
pair one setup build: each is a task of its own that a waiter's cancellation
(a client gone) does not stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import secrets
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from ..sandbox_api import IMAGE_SCHEME as IMAGE_SCHEME
from ..sandbox_api import image_from_template as image_from_template
from ..sandbox_api import image_template_name
from ..templates import TemplateNotFound
from .builder import TemplateBuilder
from .errors import BuildError

log = logging.getLogger(__name__)
MAX_SETUP_CHARS = 16 << 10
MAX_PULLS = 2  # different images pulled at once (each takes threads and disk bandwidth)
KEY_FILE = "image-names.key"


# The names this module gives: a user's pull or build may not take them (it would
# swap the image under the creates that name it).
RESERVED = re.compile(r"^(?:img-[0-9a-f]{16}|setup-[0-9a-f]{16}-[0-9a-f]{16})(?::.*)?$")


def check_name_not_reserved(name: str) -> None:
    if RESERVED.match(name.strip().lower()):
        raise BuildError(f"'{name[:80]}': names of the form img-<16 hex> and "
                         "setup-<16 hex>-<16 hex> are kept for creates from images", 400)


def setup_template_name(manifest_digest: str, setup: str) -> str:
    return (f"setup-{manifest_digest.split(':')[-1][:16]}-"
            f"{hashlib.sha256(setup.encode()).hexdigest()[:16]}")


class ImageSources:
    def __init__(self, builder: TemplateBuilder, secrets_dir: Path):
        self.builder = builder
        self.manager = builder.manager
        self.secrets_dir = secrets_dir
        self._key: bytes | None = None
        self._flights: dict[str, asyncio.Task] = {}
        self._pulls = asyncio.Semaphore(MAX_PULLS)
        # The clean-up of the names this makes (auto_cleanup): its removals under
        # way, which a create of the same name waits for, and its last-use clock.
        self.removing: dict[str, asyncio.Task] = {}
        self.on_use: Callable[[str], None] | None = None

    async def template_for(self, ref: str, credentials: dict | None = None,
                           setup: str = "", loading: str | None = None) -> str:
        """The template a create from ``ref`` (after ``setup``) starts from, made
        when missing; raises ImageError or BuildError (with their statuses)."""
        from ..images import BadReference, parse_reference

        ref = ref.strip()
        parse_reference(ref)  # syntax and bounds, before anything is named or fetched
        if len(setup) > MAX_SETUP_CHARS:
            raise BadReference(f"the setup command is longer than {MAX_SETUP_CHARS} characters")
        name = image_template_name(ref, credentials, self._secret() if credentials else b"")
        await self._settled(name)
        await self._once(name, lambda: self._pull(ref, name, credentials, loading))
        self._touch(name)  # used now: the clean-up leaves it alone past this create
        if not setup.strip():
            return name
        template = self.manager.templates.get(name)
        assert template.image is not None
        key = setup_template_name(template.image.manifest_digest, setup)
        await self._settled(key)
        await self._once(key, lambda: self._setup(name, key, setup))
        self._touch(key)
        return key

    def busy(self) -> set[str]:
        """Names a pull or setup is making right now."""
        return set(self._flights)

    async def _settled(self, name: str) -> None:
        """A clean-up removing ``name`` ends first (the create then makes it again)."""
        task = self.removing.get(name)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    def _touch(self, name: str) -> None:
        if self.on_use is not None:
            self.on_use(name)

    async def _once(self, key: str, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        task = self._flights.get(key)
        if task is None:
            task = asyncio.create_task(make(), name=f"image-{key}")
            self._flights[key] = task
            task.add_done_callback(lambda t: self._done(key, t))
        await asyncio.shield(task)

    def _done(self, key: str, task: asyncio.Task) -> None:
        if self._flights.get(key) is task:
            del self._flights[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone

    async def _pull(self, ref: str, name: str, credentials: dict | None,
                    loading: str | None = None) -> None:
        try:
            existing = self.manager.templates.get(name)
        except TemplateNotFound:
            existing = None
        if existing is not None and existing.image is not None and existing.image.source == ref:
            return
        async with self._pulls:
            log.info("images: pulling %s as template %s for a create", ref, name)
            await asyncio.to_thread(self.manager.image_cache.pull, ref, name, credentials,
                                    loading=loading)

    async def _setup(self, image_template: str, key: str, setup: str) -> None:
        try:
            if self.manager.templates.get(key).snapshot_id:
                return
        except TemplateNotFound:
            pass
        builder = self.builder
        build = builder.request(key, None, None, None)
        log.info("images: running the setup of %s once (template %s)", image_template, key)
        builder.start_build(build.template_id, build.build_id, {
            "fromTemplate": image_template, "steps": [{"type": "RUN", "args": [setup]}]})
        done = await builder.wait(build.build_id)
        if done.status != "ready":
            # (a failed step's message ends with its last output lines)
            message = str((done.reason or {}).get("message") or "the setup failed")
            raise BuildError(f"image setup failed: {message[:4000]}", 400)

    def _secret(self) -> bytes:
        """The node's key for names of images pulled with credentials (0600, kept)."""
        if self._key is None:
            path = self.secrets_dir / KEY_FILE
            try:
                self._key = path.read_bytes()
            except FileNotFoundError:
                self.secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                key = secrets.token_bytes(32)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(key)
                self._key = key
        return self._key
