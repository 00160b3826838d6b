"""An interactive shell in a sandbox over envd's PTY: raw terminal, resizes follow SIGWINCH."""

from __future__ import annotations

import os
import select
import signal
import sys
import termios
import threading
import tty
from typing import Any

from .client import Client, sdk_sandbox


def _size(fd: int) -> tuple[int, int]:
    try:
        s = os.get_terminal_size(fd)
        return s.lines or 24, s.columns or 80
    except OSError:
        return 24, 80


def attach(c: Client, sid: str) -> int:
    """Attach this terminal to a new login shell in ``sid`` until it exits; its exit code."""
    from e2b import CommandExitException, PtySize


    sbx = sdk_sandbox(c, sid)
    in_fd, out_fd = sys.stdin.fileno(), sys.stdout.fileno()
    done = threading.Event()
    # Keystrokes are read only once the shell has written something (its prompt): input
    # sent to a PTY whose process is still starting can be lost.
    ready_out = threading.Event()
    result: dict[str, Any] = {"code": 0}
    wake_r, wake_w = os.pipe()

    def on_output(data) -> None:
        os.write(out_fd, bytes(data))
        ready_out.set()

    def pump() -> None:
        try:
            handle.wait(on_pty=on_output)
        except CommandExitException as exc:
            result["code"] = exc.exit_code
        except Exception as exc:  # the stream broke: say so after the terminal is restored
            result["code"], result["error"] = 1, exc
        finally:
            done.set()
            try:
                os.write(wake_w, b"x")
            except OSError:
                pass

    resized = threading.Event()

    def on_winch(_sig, _frame) -> None:
        resized.set()
        os.write(wake_w, b"w")

    saved = None
    if os.isatty(in_fd):
        saved = termios.tcgetattr(in_fd)
        tty.setraw(in_fd, termios.TCSANOW)  # keeps what was typed ahead
    old_winch = signal.signal(signal.SIGWINCH, on_winch)
    try:
        rows, cols = _size(out_fd)
        handle = sbx.pty.create(PtySize(rows=rows, cols=cols), timeout=0,
                                envs={"TERM": os.environ.get("TERM", "xterm-256color")})
    except BaseException:
        signal.signal(signal.SIGWINCH, old_winch)
        if saved is not None:
            termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
        raise
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    ready_out.wait(10)
    try:
        stdin_open = True
        while not done.is_set():
            fds = [wake_r] + ([in_fd] if stdin_open else [])
            ready, _, _ = select.select(fds, [], [], 1.0)
            if wake_r in ready:
                os.read(wake_r, 64)
            if resized.is_set():
                resized.clear()
                rows, cols = _size(out_fd)
                try:
                    sbx.pty.resize(handle.pid, PtySize(rows=rows, cols=cols))
                except Exception:
                    pass  # a missed resize is not worth ending the session for
            if in_fd in ready and not done.is_set():
                data = os.read(in_fd, 4096)
                if not data:  # stdin ended (not a terminal): end the shell's input too
                    stdin_open = False
                    data = b"\x04"
                try:
                    sbx.pty.send_stdin(handle.pid, data)
                except Exception:
                    if done.wait(3):  # the shell had just ended: its exit code stands
                        break
                    raise
    finally:
        signal.signal(signal.SIGWINCH, old_winch)
        if saved is not None:
            termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
        if not done.is_set():
            try:
                sbx.pty.kill(handle.pid)
            except Exception:
                pass
        thread.join(5)
        os.close(wake_r)
        os.close(wake_w)
    if "error" in result:
        from .config import CliError

        raise CliError(f"shell in {sid} ended: {result['error']}")
    return result["code"]
