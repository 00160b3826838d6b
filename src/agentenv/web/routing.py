"""Which sandbox port a request is for, as E2B addresses it: ``E2b-Sandbox-Id`` and
``E2b-Sandbox-Port`` headers, or a Host of ``<port>-<sandboxID>.<domain>``."""

from __future__ import annotations

import re

from starlette.types import Scope

from .relay import SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER, BadTarget

# new_sandbox_id() makes 20 of [a-z0-9]; a little room, and nothing else.
_SANDBOX_ID = re.compile(r"[a-z0-9]{1,64}")
_PORT = re.compile(r"[0-9]{1,5}")
_PORT_SUFFIX = re.compile(r":[0-9]{1,5}$")


class SandboxRouting:
    def __init__(self, domain: str) -> None:
        # A domain may name the port its URLs use (``localhost:8000``): Hosts match by
        # name, with any port (a TLS terminator in front may have dropped it).
        name = domain.lower().rsplit(":", 1)[0] if _PORT_SUFFIX.search(domain) else domain
        self._host = re.compile(
            r"(?P<port>[0-9]{1,5})-(?P<sid>[a-z0-9]{1,64})\." + re.escape(name.lower())
            + r"(:[0-9]{1,5})?"
        )

    def target(self, scope: Scope) -> tuple[str, int] | None:
        """``(sandbox ID, port)``, or None for a request to the API itself.

        Raises BadTarget when the request names a sandbox but not a valid one.
        """
        sid = port = host = None
        for key, value in scope["headers"]:
            name = key.decode("latin-1").lower()
            if name == SANDBOX_ID_HEADER:
                sid = value.decode("latin-1")
            elif name == SANDBOX_PORT_HEADER:
                port = value.decode("latin-1")
            elif name == "host":
                host = value.decode("latin-1").lower()
        if sid is not None:
            if not _SANDBOX_ID.fullmatch(sid):
                raise BadTarget("invalid sandbox ID in the E2b-Sandbox-Id header")
            if port is None or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
                raise BadTarget(f"invalid sandbox port for sandbox {sid}")
            return sid, int(port)
        match = self._host.fullmatch(host or "")
        if match is None:
            return None
        if not 0 < int(match["port"]) < 65536:
            raise BadTarget(f"invalid sandbox port for sandbox {match['sid']}")
        return match["sid"], int(match["port"])
