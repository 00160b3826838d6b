"""Templates: named root filesystems (with resources) that sandboxes start from."""

from .registry import ImageInfo, Template, TemplateNotFound, TemplateRegistry

__all__ = ["ImageInfo", "Template", "TemplateNotFound", "TemplateRegistry"]
