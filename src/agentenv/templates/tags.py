"""E2B's ``name:tag`` references: a tag names one build of a template.

A name without a tag means the ``default`` tag, which every build takes unless it
names its own tags (E2B's rule). Tags are E2B's charset (lowercase letters, digits,
'.', '_' and '-', given in any case and trimmed, as E2B normalises them), here also
bounded in length and starting with a letter or digit, and never a UUID (E2B's rule:
a UUID reads as a build ID).
"""

from __future__ import annotations

import re
import uuid

DEFAULT_TAG = "default"
SEPARATOR = ":"
TAG_MAX_LENGTH = 64
TAG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
TAG_RULE = ("1-64 characters of a-z, 0-9, '.', '_' and '-', starting with a letter or "
            "digit, not a UUID")
MAX_TAGS = 32  # per template: each keeps a build (and its snapshot) alive
_TAG = re.compile(TAG_PATTERN)


class InvalidTag(ValueError):
    pass


def normalize_tag(tag: str) -> str:
    """The tag as stored (trimmed, lowercase); InvalidTag says the rule."""
    if not isinstance(tag, str):
        raise InvalidTag(f"invalid tag {tag!r}: use {TAG_RULE}")
    clean = tag.strip().lower()
    if not _TAG.fullmatch(clean):
        raise InvalidTag(f"invalid tag {tag[:80]!r}: use {TAG_RULE}")
    try:
        uuid.UUID(clean)
    except ValueError:
        return clean
    raise InvalidTag(f"invalid tag {tag!r}: a tag cannot be a UUID")


def normalize_tags(tags: list[str]) -> list[str]:
    """Each tag normalised, duplicates dropped, order kept; at least one."""
    if not isinstance(tags, list) or not tags:
        raise InvalidTag("at least one tag is required")
    if len(tags) > MAX_TAGS:
        raise InvalidTag(f"at most {MAX_TAGS} tags at once")
    return list(dict.fromkeys(normalize_tag(t) for t in tags))


def split_ref(ref: str) -> tuple[str, str | None]:
    """``name:tag`` -> (name, tag); (name, None) when no tag is given. The tag is
    checked (InvalidTag); the name is the caller's to look up."""
    name, sep, tag = ref.partition(SEPARATOR)
    return name.strip(), normalize_tag(tag) if sep else None
