"""A build's base template: the one named by fromTemplate, or for fromImage a
built-in or local template standing for the image, or else the image pulled as a
template of its own."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# Named alike by the nodes and the gateway (which prefers a node holding the image).
from ..sandbox_api import image_template_name as image_template_name
from ..templates import Template, TemplateNotFound
from .errors import StepFailed

if TYPE_CHECKING:
    from ..orchestrator import SandboxManager

# The templates creates from images make (image_sources): their names are their IDs,
# so that finding one is a directory lookup, never a scan of every template's record.
AUTO_ID = re.compile(r"^(?:img-[0-9a-f]{16}|setup-[0-9a-f]{16}-[0-9a-f]{16})$")


# E2B's default base image is the counterpart of the built-in ``base`` template.
BASE_IMAGES = {"e2bdev/base": "base"}


async def resolve_base(manager: SandboxManager, spec: dict[str, Any],
                       say: Callable[[str], None]) -> Template:
    """The template the build starts from; ``say`` logs a line of the ``base`` step."""
    registry = manager.templates
    name = spec.get("fromTemplate")
    if not name:
        image = spec["fromImage"]
        repo = image.split("@")[0].rsplit(":", 1)[0] if ":" in image.split("/")[-1] \
            else image.split("@")[0]
        # As docker does with its local images: a template of this node named
        # like the image (``FROM py`` after ``aenv pull ... --name py``) is used.
        name = BASE_IMAGES.get(repo.removeprefix("docker.io/")) or \
            _local_template(manager, image) or \
            await _pull(manager, say, image, spec.get("fromImageRegistry"),
                        bool(spec.get("force")))
    try:
        return registry.get(name)
    except TemplateNotFound:
        raise StepFailed(f"base template '{name}' not found", "base") from None


def _local_template(manager: SandboxManager, image: str) -> str:
    if "/" in image or "@" in image:
        return ""
    try:
        return manager.templates.get(image.removesuffix(":latest")).template_id
    except TemplateNotFound:
        return ""


async def _pull(manager: SandboxManager, say: Callable[[str], None], image: str,
                registry: dict | None, force: bool) -> str:
    """The image as a template of its own (``img-<hash of the reference>``), pulled
    unless already there; the built template shares its layers."""
    from ..images import ImageError

    name = image_template_name(image)
    credentials = None
    if registry:
        if registry.get("type", "registry") != "registry":
            raise StepFailed(f"image '{image}': {registry.get('type')} registry "
                             "credentials are not supported; use username/password", "base")
        credentials = {"username": registry.get("username", ""),
                       "password": registry.get("password", "")}
    with contextlib.suppress(TemplateNotFound):
        existing = manager.templates.get(name)
        if existing.image is not None and existing.image.source == image and not force:
            say(f"Image {image} is cached")
            return name
    say(f"Pulling {image}")
    seen: set[str] = set()

    def progress(event: dict) -> None:
        status = str(event.get("status", ""))
        if status and status not in seen and status != "done":
            seen.add(status)
            say(f"{image}: {status}")

    cancel = threading.Event()
    try:
        await asyncio.to_thread(manager.image_cache.pull, image, name, credentials,
                                progress=progress, cancel=cancel)
    except asyncio.CancelledError:
        cancel.set()
        raise
    except ImageError as exc:
        raise StepFailed(f"pulling image '{image}' failed: {exc}", "base") from exc
    return name
