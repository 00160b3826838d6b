"""schemathesis hooks for tests/test_fuzz_api.py (loaded via SCHEMATHESIS_HOOKS).

`not_a_capacity_excused_server_error` replaces schemathesis' `not_a_server_error`:
the node declares one 5xx a client must expect, a 503 saying it is at capacity
(the stateful phase creates sandboxes until the node is full). Every other 5xx,
and a 503 for any other reason, fails.
"""

from __future__ import annotations

import schemathesis

CAPACITY_MESSAGES = ("node is at capacity", "no network slot free")


@schemathesis.check
def not_a_capacity_excused_server_error(ctx, response, case) -> bool | None:
    if response.status_code < 500:
        return None
    if response.status_code == 503:
        try:
            message = response.json().get("message", "")
        except ValueError:
            message = ""
        if message.startswith(CAPACITY_MESSAGES):
            return None
    raise AssertionError(f"server error {response.status_code}: {response.text[:500]}")
