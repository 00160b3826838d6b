"""Templates: named root filesystems (with resources) that sandboxes start from."""

from .registry import Template, TemplateNotFound, TemplateRegistry

__all__ = ["Template", "TemplateNotFound", "TemplateRegistry"]
