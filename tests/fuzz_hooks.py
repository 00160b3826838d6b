"""schemathesis hooks for tests/test_fuzz_api.py (loaded via SCHEMATHESIS_HOOKS).

`not_a_capacity_excused_server_error` replaces schemathesis' `not_a_server_error`:
the node declares two 5xx a client must expect: a 503 saying it is at capacity
(the stateful phase creates sandboxes until the node is full), and a 502 saying an
image's registry is unreachable (a create or pull from a well-formed reference: the
fuzzing node has no registry to reach). Every other 5xx, and a 503 or 502 for any
other reason, fails.
"""

from __future__ import annotations

import re

import schemathesis

CAPACITY_MESSAGES = ("node is at capacity", "no network slot free")
REGISTRY_UNREACHABLE = re.compile(r"[\w.:-]+ unreachable: ")


@schemathesis.check
def not_a_capacity_excused_server_error(ctx, response, case) -> bool | None:
    if response.status_code < 500:
        return None
    try:
        message = str(response.json().get("message", ""))
    except (ValueError, AttributeError):
        message = ""
    if response.status_code == 503 and message.startswith(CAPACITY_MESSAGES):
        return None
    if response.status_code == 502 and REGISTRY_UNREACHABLE.match(message):
        return None
    raise AssertionError(f"server error {response.status_code}: {response.text[:500]}")
