"""envd's shared state: access token, default env/user/workdir, user lookup, paths."""

from __future__ import annotations

import base64
import hmac
import os
import pwd
from dataclasses import dataclass, field

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FALLBACK_USER = "user"
# How file operations (/files, the Filesystem service) act for a request's user:
# "root" as E2B's envd does them (as root; what is created is chowned to the user),
# "user" in a worker holding the user's own credentials (strict; docs/security.md).
FILE_ACCESS_MODES = ("root", "user")
MAX_PATH = 4096  # PATH_MAX: no longer path names anything


class UserError(Exception):
    """The requested user does not exist in the sandbox."""


class PathError(Exception):
    """A path argument is malformed."""


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str

    @classmethod
    def lookup(cls, name: str) -> User:
        try:
            # Images name their user by uid too (``USER 1000``).
            pw = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except KeyError:
            raise UserError(f"invalid user: user '{name}' does not exist in the sandbox") from None
        except OSError as e:  # no /etc/passwd at all
            raise UserError(f"invalid user: cannot look up user '{name}': {e}") from None
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir or "/", pw.pw_shell or "/bin/sh")


_ROOT = User("root", 0, 0, "/root", "/bin/sh")


@dataclass
class State:
    access_token: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    default_user: str | None = None
    default_workdir: str | None = None
    file_access: str = "root"

    # -- across dormancy (dormancy.py) ----------------------------------------------
    def saved(self) -> dict:
        """What /init set, for envd's next start in this boot."""
        return {"access_token": self.access_token, "env_vars": self.env_vars,
                "default_user": self.default_user, "default_workdir": self.default_workdir,
                "file_access": self.file_access}

    def restore(self, saved: dict) -> None:
        token = saved.get("access_token")
        if isinstance(token, str) and token:
            self.access_token = token
        env = saved.get("env_vars")
        if isinstance(env, dict):
            self.env_vars.update({k: v for k, v in env.items()
                                  if isinstance(k, str) and isinstance(v, str)})
        for attr in ("default_user", "default_workdir"):
            value = saved.get(attr)
            if isinstance(value, str) and value:
                setattr(self, attr, value)
        if saved.get("file_access") in FILE_ACCESS_MODES:
            self.file_access = saved["file_access"]

    # -- access token ---------------------------------------------------------------
    def token_ok(self, presented: str | None) -> bool:
        if self.access_token is None:
            return True
        if presented is None:
            return False
        return hmac.compare_digest(presented.encode(), self.access_token.encode())

    # -- users -----------------------------------------------------------------------
    def resolve_user(self, name: str | None) -> User:
        """The user named by a request, or the default one when it names none."""
        if name:
            return User.lookup(name)
        # A pulled image rarely has the node's default user: fall back, as a
        # container runtime runs an image with no USER as root.
        for candidate in (self.default_user, FALLBACK_USER, "root"):
            if candidate:
                try:
                    return User.lookup(candidate)
                except UserError:
                    pass
        return _ROOT  # rootfs without /etc/passwd

    def user_from_authorization(self, header: str | None) -> User:
        """``Authorization: Basic base64("user:")`` as the SDK sends it."""
        name = None
        if header:
            scheme, _, value = header.partition(" ")
            if scheme.lower() == "basic" and value:
                try:
                    decoded = base64.b64decode(value.strip(), validate=False).decode()
                except (ValueError, UnicodeDecodeError):
                    raise UserError("invalid Authorization header") from None
                name = decoded.partition(":")[0]
        return self.resolve_user(name)

    # -- environment -----------------------------------------------------------------
    def process_env(self, user: User, extra: dict[str, str] | None) -> dict[str, str]:
        env = {
            "PATH": DEFAULT_PATH,
            "HOME": user.home,
            "USER": user.name,
            "LOGNAME": user.name,
            "SHELL": user.shell,
        }
        env.update(self.env_vars)
        if extra:
            env.update(extra)
        return env

    def default_cwd(self, user: User) -> str:
        for cand in (self.default_workdir, user.home):
            if cand and os.path.isdir(cand):
                return cand
        return "/"


def resolve_path(path: str, user: User, *, allow_empty: bool = False) -> str:
    """Absolute, normalised path; relative paths are relative to the user's home."""
    if "\x00" in path:
        raise PathError("invalid path: contains a NUL byte")
    if len(path) > MAX_PATH:
        raise PathError(f"invalid path: longer than {MAX_PATH} characters")
    if not path:
        if allow_empty:
            return user.home
        raise PathError("invalid path: path is empty")
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    elif not path.startswith("/"):
        path = os.path.join(user.home, path)
    return os.path.normpath(path)
