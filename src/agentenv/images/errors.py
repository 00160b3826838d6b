"""Errors of image pulls and the layer store; each carries the HTTP status it maps to."""

from __future__ import annotations

from ..errors import AgentenvError


class ImageError(AgentenvError):
    status = 500


class BadReference(ImageError):
    status = 400


class ImageNotFound(ImageError):
    status = 404


class RegistryUnavailable(ImageError):
    """The registry could not be reached or answered with a server error."""
    status = 502


class RegistryAuthError(ImageError):
    status = 401


class HostileInput(ImageError):
    """The image is malformed or malicious: oversized documents, digest mismatches,
    truncated layers, tar entries that would write outside their layer."""
    status = 422


class CacheTooSmall(ImageError):
    status = 507


class ImageInUse(ImageError):
    status = 409


class PullCancelled(ImageError):
    status = 499
