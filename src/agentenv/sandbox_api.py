"""The sandbox API's rules that a node and the cluster's gateway both apply: the
lifecycle errors and their statuses, the states and filters of a listing, the bounds
of an ``Idempotency-Key``, and how a create from an image names its template.

The node's packages (``orchestrator``, ``builds``, ``api``) re-export these, and the
gateway and scheduler import them from here: this module imports nothing but the error
family, so starting a control plane loads none of the node (runtime, network, images,
snapshots; a contract in pyproject.toml keeps it so).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote

from .errors import AgentenvError

# -- errors ---------------------------------------------------------------------------


class OrchestratorError(AgentenvError):
    """An error of the sandbox lifecycle (its subclasses say which status)."""

    status = 500


class BadRequest(OrchestratorError):
    status = 400


class NotFound(OrchestratorError):
    status = 404


class Conflict(OrchestratorError):
    status = 409


class CapacityExceeded(OrchestratorError):
    status = 503


# -- listings -------------------------------------------------------------------------

# The states a listing shows unless asked otherwise, as the E2B API spells them (the
# SDKs know no others: an unknown state fails their parsing of the whole list).
LISTED_STATES = ("running", "paused")
# Shown only when asked for by name (agentenv's own: ``aenv ls --state error``; a
# cluster's gateway lists sandboxes ``lost`` with their node, which no node has).
EXTRA_STATES = ("error", "lost")
# A node's create answers the sandbox as a listing shows it in this header (JSON), for
# a cluster's gateway to index it at once; the gateway does not pass it on.
LISTED_HEADER = "x-aenv-listed"


def parse_states(values: Iterable[str]) -> frozenset[str]:
    """``state`` as the SDKs send it: comma-separated, possibly repeated."""
    states = {s.strip() for v in values for s in v.split(",") if s.strip()}
    unknown = states - set(LISTED_STATES) - set(EXTRA_STATES)
    if unknown:
        raise BadRequest(
            f"invalid state {sorted(unknown)[0]!r}: expected one of "
            f"{', '.join(LISTED_STATES + EXTRA_STATES)}"
        )
    return frozenset(states) if states else frozenset(LISTED_STATES)


def parse_metadata(raw: str | None) -> dict[str, str]:
    """``metadata`` is itself a query string, ``k1=v1&k2=v2``, whose keys and values
    are URL-encoded once more before the pairs are joined (as both SDKs send it)."""
    if not raw:
        return {}
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise BadRequest(f"invalid metadata query {raw!r}: expected key=value pairs") from None
    return {unquote(k): unquote(v) for k, v in pairs}


# -- creates --------------------------------------------------------------------------

# An Idempotency-Key is 1..MAX_KEY_CHARS printable ASCII characters.
MAX_KEY_CHARS = 255

# A template ID naming an image (the e2b SDK's ``template``): ``docker://`` and a
# registry reference, as containers-transports(5) spells it.
IMAGE_SCHEME = "docker://"


def image_from_template(template: str) -> str | None:
    """The image reference a template ID names by the ``docker://`` scheme, else None."""
    return template[len(IMAGE_SCHEME):] if template.startswith(IMAGE_SCHEME) else None


def image_template_name(ref: str, credentials: dict | None = None, key: bytes = b"") -> str:
    """``img-<hash>``: of the reference alone, or keyed (HMAC) over it and the credentials."""
    if not credentials:
        return "img-" + hashlib.sha256(ref.encode()).hexdigest()[:16]
    text = "\0".join((ref, str(credentials.get("username", "")),
                      str(credentials.get("password", ""))))
    return "img-" + hmac.new(key, text.encode(), hashlib.sha256).hexdigest()[:16]
