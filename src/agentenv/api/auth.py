"""The node's API key: generated once into a 0600 file, compared in constant time."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

KEY_FILE = "api-key"


def load_or_create_api_key(secrets_dir: Path) -> str:
    secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(secrets_dir, 0o700)
    path = secrets_dir / KEY_FILE
    try:
        key = path.read_text().strip()
        if key:
            os.chmod(path, 0o600)
            return key
    except FileNotFoundError:
        pass
    key = "aenv_" + secrets.token_hex(24)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.replace(tmp, path)
    return key


def key_matches(given: str | None, expected: str) -> bool:
    if not given:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())
