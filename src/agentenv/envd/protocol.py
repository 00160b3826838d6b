"""What the host and envd agree on: envd's port, the version it reports, and how a
``/files`` URL is signed. Both sides import these from here (and nothing else of each
other's), so they cannot drift apart."""

from __future__ import annotations

import base64
import hashlib

# Where envd listens inside every sandbox (E2B's port: the SDKs assume it).
ENVD_PORT = 49983
# How long a client keeps an idle connection to a sandbox for reuse: well under the
# shortest envd_dormant_after_s (1 s). envd closes its idle connections as it goes
# dormant, and a request sent on one at that moment is lost unanswered ("server
# disconnected"); a connection idle that long is not reused but opened anew, which the
# stub answers by waking envd.
SANDBOX_KEEPALIVE_S = 0.5

# Reported to SDKs as the sandbox's ``envdVersion``; the SDKs gate features on it, and
# every feature up to this version is implemented.
ENVD_VERSION = "0.6.4"


def file_signature(path: str, operation: str, username: str, token: str,
                   expiration: int | None) -> str:
    """E2B's v1 signature of a ``/files`` URL (as ``e2b.sandbox.signature`` makes it)."""
    raw = f"{path}:{operation}:{username}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")
