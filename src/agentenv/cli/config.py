"""Where the CLI finds its server: ``config.toml`` (written by ``aenv auth``) and the environment.

The file is ``$AENV_CONFIG_DIR/config.toml``, else ``$XDG_CONFIG_HOME/aenv/config.toml``,
else ``~/.config/aenv/config.toml``. ``AENV_API_URL`` and ``AENV_API_KEY`` win over it.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w


class CliError(Exception):
    """An error the CLI reports as one line on stderr."""

    exit_code = 1


def config_dir() -> Path:
    if os.environ.get("AENV_CONFIG_DIR"):
        return Path(os.environ["AENV_CONFIG_DIR"])
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg else Path.home() / ".config"
    return base / "aenv"


def config_path() -> Path:
    return config_dir() / "config.toml"


@dataclass
class Credentials:
    url: str
    key: str


def read_file() -> dict[str, str]:
    path = config_path()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc
    return {k: str(v) for k, v in data.items() if k in ("api_url", "api_key")}


def write_file(url: str, key: str) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        tomli_w.dump({"api_url": url, "api_key": key}, f)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def credentials() -> Credentials:
    stored = read_file()
    url = os.environ.get("AENV_API_URL") or stored.get("api_url")
    key = os.environ.get("AENV_API_KEY") or stored.get("api_key")
    if not url or not key:
        raise CliError("not logged in: run `aenv auth` (or set AENV_API_URL and AENV_API_KEY)")
    return Credentials(url=url.rstrip("/"), key=key)
