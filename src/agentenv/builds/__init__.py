"""Template builds (E2B's build API): a build's steps run in a sandbox of its base
template, then the sandbox is snapshotted with its start command running and
published as a template. A client of the orchestrator, as the API is."""

from .auto_cleanup import TemplateCleanup
from .builder import TemplateBuilder
from .context_files import HASH, UPLOAD_URL_TTL
from .errors import BuildError
from .image_sources import ImageSources, check_name_not_reserved, image_from_template

__all__ = ["HASH", "UPLOAD_URL_TTL", "BuildError", "ImageSources", "TemplateBuilder",
           "TemplateCleanup",
           "check_name_not_reserved", "image_from_template"]
