"""The ``sudo`` a sandbox's users run (the bundle's ``bin/sudo``): asks envd's broker
(see ``sudo``) to run the real sudo as root with this argv, environment, working
directory and stdio, passes on the signals it gets, and ends as the command did."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from .sudo import ADDRESS, FORWARDED

# What bin/sudo set for this interpreter alone; the caller's own values were saved.
OWN_VARS = ("PYTHONHOME",)
SAVED_PREFIX = "AENV_SUDO_SAVED_"


def _caller_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in OWN_VARS and not k.startswith(SAVED_PREFIX)}
    for name in OWN_VARS:
        saved = os.environ.get(SAVED_PREFIX + name)
        if saved is not None:
            env[name] = saved
    return env


def main() -> int:
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "/"
    request = json.dumps({"argv": sys.argv[1:], "env": _caller_env(), "cwd": cwd}).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(ADDRESS)
        if sock.recv(16) != b"R":  # the broker reads credentials from here on
            raise OSError("envd's sudo broker did not answer")
        socket.send_fds(sock, [request], [0, 1, 2])
    except OSError as e:
        print(f"sudo: cannot reach envd: {e}", file=sys.stderr)
        return 1

    def forward(sig: int, _frame) -> None:
        try:
            sock.send(f"S {sig}".encode())
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            reply = sock.recv(4096)
        except InterruptedError:
            continue
        break
    if reply.startswith(b"E "):
        code = int(reply[2:])
        if code < 0:  # killed by a signal: end the same way, as a shell expects
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
            return 128 - code
        return code
    message = reply[2:].decode(errors="replace") if reply.startswith(b"X ") else "no answer"
    print(f"sudo: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
