"""The client commands: sandboxes, snapshots, exec, files and shells, over the node's HTTP API."""

from __future__ import annotations

import shlex
import sys
import threading
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import typer

from ..failover import split_urls
from . import output
from .client import ApiError, Client, sdk_sandbox
from .config import CliError, Credentials, config_path, read_file, write_file

cli = typer.Typer()
snapshot_app = typer.Typer(help="Snapshots: create, list, remove.", no_args_is_help=True)
cli.add_typer(snapshot_app, name="snapshot")

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _pairs(values: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values or []:
        if "=" not in v:
            raise CliError(f"invalid {what} '{v}': expected KEY=VALUE")
        k, _, val = v.partition("=")
        out[k] = val
    return out


# -- auth ---------------------------------------------------------------------------

@cli.command()
def auth(
    url: Annotated[str | None, typer.Option(
        help="Server URL, e.g. http://127.0.0.1:8000; several gateways' URLs comma-separated "
             "(a request that cannot connect to one goes to the next)")] = None,
    key: Annotated[str | None, typer.Option(help="API key (X-API-Key).")] = None,
    verify: Annotated[bool, typer.Option(help="Check the URL and key with the server.")] = True,
) -> None:
    """Store the server URL and API key in the CLI's config.toml (mode 0600)."""
    stored = read_file()
    if url is None:
        url = typer.prompt("Server URL", default=stored.get("api_url", "http://127.0.0.1:8000"))
    if key is None:
        key = typer.prompt("API key", hide_input=True)
    key = key.strip()
    try:
        url = ",".join(split_urls(url))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not key:
        raise CliError("empty API key")
    if verify:
        with Client(Credentials(url, key), timeout=15) as c:
            c.request("GET", "/sandboxes")
    path = write_file(url, key)
    output.err.print(f"Saved credentials for {url} to {path}")


# -- sandboxes ----------------------------------------------------------------------

def _create(c: Client, template: str, timeout: int | None, metadata: list[str] | None,
            env: list[str] | None, auto_pause: bool | None, image: dict | None = None) -> dict:
    body: dict = image or {"templateID": template}
    if timeout is not None:
        body["timeout"] = timeout
    if metadata:
        body["metadata"] = _pairs(metadata, "metadata")
    if env:
        body["envVars"] = _pairs(env, "env var")
    if auto_pause is not None:
        body["autoPause"] = auto_pause
    return c.json("POST", "/sandboxes", json=body)


@cli.command()
def start(
    template: Annotated[str, typer.Argument(help="A template, or a snapshot ID or name.")
                        ] = "",
    image: Annotated[str | None, typer.Option(
        "--image", help="Start from this image (pulled on first use) instead.")] = None,
    setup: Annotated[str | None, typer.Option(
        "--setup", help="With --image: a command run once per image, then kept.")] = None,
    username: Annotated[str | None, typer.Option(help="With --image: registry user.")] = None,
    password_env: Annotated[str | None, typer.Option(
        "--password-env", help="With --image: variable holding the registry password.")
                            ] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Print the ID, no shell.")] = False,
    timeout: Annotated[int | None, typer.Option(help="Time to live in seconds.")] = None,
    metadata: Annotated[list[str] | None, typer.Option("--metadata", "-m",
                                                       help="KEY=VALUE (repeatable).")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e",
                                                  help="KEY=VALUE (repeatable).")] = None,
    auto_pause: Annotated[bool | None, typer.Option(
        "--auto-pause/--no-auto-pause", help="On expiry pause (default) or delete.")] = None,
    rm: Annotated[bool, typer.Option("--rm", help="Remove the sandbox when the shell ends.")
                  ] = False,
) -> None:
    """Start a sandbox and attach a shell to it (or print its ID with --detach)."""
    from .pull import image_body

    body = image_body(template, image, setup, username, password_env)
    with Client(timeout=600 if body else 120) as c:
        created = _create(c, template, timeout, metadata, env, auto_pause, body)
        sid = created["sandboxID"]
        if detach:
            typer.echo(sid)
            return
        from .shell import attach

        code = attach(c, sid)
        if rm:
            c.request("DELETE", f"/sandboxes/{sid}")
        else:
            output.err.print(f"Left sandbox {sid} running: `aenv cn {sid}` reattaches, "
                             f"`aenv rm {sid}` removes it.")
    raise typer.Exit(code)


@cli.command()
def cn(sandbox: Annotated[str, typer.Argument(help="Sandbox ID or unique prefix.")]) -> None:
    """Attach a shell to a running (or paused) sandbox."""
    from .shell import attach

    with Client() as c:
        code = attach(c, c.resolve(sandbox))
    raise typer.Exit(code)


@cli.command("ls")
def ls(
    state: Annotated[list[str] | None, typer.Option(
        "--state", "-s", help="running, paused or error (repeatable).")] = None,
    metadata: Annotated[list[str] | None, typer.Option(
        "--metadata", "-m", help="KEY=VALUE that must match (repeatable).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List sandboxes."""
    with Client() as c:
        items = c.sandboxes(state, _pairs(metadata, "metadata"))
    if as_json:
        output.print_json(items)
        return
    rows = [[s["sandboxID"], s.get("templateID", ""), s.get("state", ""),
             output.ago(s.get("startedAt")),
             output.until(s.get("endAt")) if s.get("state") == "running" else "-",
             ",".join(f"{k}={v}" for k, v in (s.get("metadata") or {}).items())]
            for s in items]
    output.table(["SANDBOX ID", "TEMPLATE", "STATE", "STARTED", "EXPIRES", "METADATA"], rows)


def _each(ids: list[str], action) -> None:
    """Run ``action(client, full_id)`` for every ID; report each failure, exit 1 if any."""
    failed = 0
    with Client() as c:
        for ref in ids:
            try:
                sid = c.resolve(ref)
                action(c, sid)
                typer.echo(sid)
            except CliError as exc:
                failed += 1
                output.err.print(f"aenv: {ref}: {exc}", markup=False)
    if failed:
        raise typer.Exit(1)


IdsArg = Annotated[list[str], typer.Argument(help="Sandbox IDs or unique prefixes.")]


@cli.command()
def rm(sandboxes: IdsArg) -> None:
    """Remove (kill) sandboxes."""
    _each(sandboxes, lambda c, sid: c.request("DELETE", f"/sandboxes/{sid}"))


@cli.command()
def pause(
    sandboxes: IdsArg,
    files_only: Annotated[bool, typer.Option(
        "--files-only", help="Keep the files only: a resume reboots the sandbox.")] = False,
    evict: Annotated[bool, typer.Option(
        "--evict", help="Free the sandbox's memory now (a resume then restores it), "
        "not at its idle time.")] = False,
) -> None:
    """Pause sandboxes: memory, processes and files are saved."""
    def one(c: Client, sid: str) -> None:
        c.request("POST", f"/sandboxes/{sid}/pause", json={"memory": not files_only})
        if evict and not files_only:
            c.request("POST", f"/sandboxes/{sid}/evict")

    _each(sandboxes, one)


@cli.command()
def resume(
    sandboxes: IdsArg,
    timeout: Annotated[int | None, typer.Option(help="New time to live in seconds.")] = None,
) -> None:
    """Resume paused sandboxes exactly where they were."""
    body = {"timeout": timeout} if timeout is not None else {}
    _each(sandboxes, lambda c, sid: c.request("POST", f"/sandboxes/{sid}/resume", json=body))


@cli.command()
def reset(
    sandbox: Annotated[str, typer.Argument(help="Sandbox ID or unique prefix.")],
    snapshot: Annotated[str | None, typer.Argument(
        help="Snapshot ID, unique prefix or name (default: the sandbox's last snapshot).")
    ] = None,
    timeout: Annotated[int | None, typer.Option(
        help="New time to live in seconds (default: the sandbox keeps its expiry).")] = None,
    files: Annotated[bool, typer.Option(
        "--files", help="Filesystem mode, for tasks whose state is their files: after the "
        "first reset to a snapshot, the files go back in place in milliseconds, no "
        "restore (the snapshot's own processes keep running).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Bring a sandbox back to a snapshot's memory, processes and files, in place: same
    ID and access tokens, so connected clients go on working."""
    body: dict = {"mode": "filesystem"} if files else {}
    if timeout is not None:
        body["timeout"] = timeout
    with Client() as c:
        sid = c.resolve(sandbox)
        if snapshot is not None:
            body["snapshotID"] = c.resolve_snapshot(snapshot)
        what = f"snapshot {body['snapshotID']}" if snapshot is not None else "its last snapshot"
        with output.err.status(f"Resetting {sid} to {what}..."):
            result = c.json("POST", f"/sandboxes/{sid}/reset", json=body)
    if as_json:
        output.print_json(result)
        return
    how = " (its files, in place)" if result.get("mode") == "filesystem" else ""
    output.err.print(f"Reset {sid} to snapshot {result['snapshotID']}{how}; it expires "
                     f"{output.until(result.get('endAt'))}.", markup=False)
    typer.echo(sid)


@cli.command("timeout")
def set_timeout(
    sandbox: Annotated[str, typer.Argument(help="Sandbox ID or unique prefix.")],
    seconds: Annotated[int, typer.Argument(help="The sandbox expires this many seconds from now.")],
) -> None:
    """Set when a sandbox expires."""
    with Client() as c:
        sid = c.resolve(sandbox)
        c.request("POST", f"/sandboxes/{sid}/timeout", json={"timeout": seconds})


# -- exec ---------------------------------------------------------------------------

@cli.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(
    sandbox: Annotated[str, typer.Argument(help="Sandbox ID or unique prefix.")],
    command: Annotated[list[str], typer.Argument(help="The command and its arguments.")],
    user: Annotated[str | None, typer.Option("--user", "-u", help="user or root.")] = None,
    cwd: Annotated[str | None, typer.Option("--cwd", "-w", help="Working directory.")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE.")] = None,
    interactive: Annotated[bool, typer.Option(
        "--interactive", "-i", help="Send this stdin to the command (until EOF).")] = False,
) -> None:
    """Run a command in a sandbox: its stdout and stderr stream apart, its exit code is ours.

    Options go before the ID: aenv exec -i ID -- CMD..."""
    from e2b import CommandExitException

    if command and command[0] == "--":  # parsing stops at ID, so a `--` after it is kept
        command = command[1:]
    if not command:
        raise CliError("no command given: aenv exec ID -- CMD...")
    envs = _pairs(env, "env var")
    with Client() as c:
        sid = c.resolve(sandbox)
        sbx = sdk_sandbox(c, sid)

    def put(stream):
        def write(data: str) -> None:
            stream.write(data)
            stream.flush()
        return write

    cmd = command[0] if len(command) == 1 else shlex.join(command)
    try:
        if interactive:
            handle = sbx.commands.run(cmd, background=True, stdin=True, user=user, cwd=cwd,
                                      envs=envs or None, timeout=0)
            threading.Thread(target=_feed_stdin, args=(sbx, handle.pid), daemon=True).start()
            result = handle.wait(on_stdout=put(sys.stdout), on_stderr=put(sys.stderr))
        else:
            result = sbx.commands.run(cmd, on_stdout=put(sys.stdout), on_stderr=put(sys.stderr),
                                      user=user, cwd=cwd, envs=envs or None, timeout=0)
        code = result.exit_code
    except CommandExitException as exc:
        code = exc.exit_code
    raise typer.Exit(code)


def _feed_stdin(sbx, pid: int) -> None:
    """Our stdin to the command's, then EOF. The command may end first: that is fine."""
    import os

    def chunks():
        while data := os.read(sys.stdin.fileno(), 65536):
            yield data

    try:
        sbx.commands.stream_input(pid, chunks(), timeout=0)
        sbx.commands.close_stdin(pid)
    except Exception:
        pass


# -- fork and snapshots ----------------------------------------------------------------

@cli.command()
def fork(
    sandbox: Annotated[str, typer.Argument(help="Sandbox ID or unique prefix.")],
    count: Annotated[int, typer.Option("--count", "-n", help="Children to create, 1..16.")] = 1,
    timeout: Annotated[int | None, typer.Option(help="Children's time to live in seconds.")
                       ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Branch a running sandbox into children that continue its exact state."""
    body: dict = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout
    results = []
    with Client() as c:
        # Each child as it comes up: its ID is usable while the others are restored.
        for r in c.lines("POST", f"/sandboxes/{c.resolve(sandbox)}/fork", json=body):
            results.append(r)
            if as_json:
                continue
            if r.get("sandbox"):
                typer.echo(r["sandbox"]["sandboxID"])
            else:
                output.err.print(f"aenv: child failed: {r['error']['message']}", markup=False)
    if as_json:
        output.print_json(results)
    if any(r.get("error") for r in results):
        raise typer.Exit(1)


@snapshot_app.command("create")
def snapshot_create(
    sandbox: Annotated[str, typer.Argument(help="Sandbox ID or unique prefix.")],
    name: Annotated[str | None, typer.Option("--name", help="A name to start it by.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Capture a running sandbox (stopped only for the capture); prints the snapshot ID."""
    with Client() as c:
        info = c.json("POST", f"/sandboxes/{c.resolve(sandbox)}/snapshots",
                      json={"name": name} if name else {})
    if as_json:
        output.print_json(info)
    else:
        typer.echo(info["snapshotID"])


@snapshot_app.command("ls")
def snapshot_ls(
    sandbox_id: Annotated[str | None, typer.Option("--sandbox-id", help="Of this sandbox only.")
                          ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List snapshots (also of sandboxes since removed)."""
    with Client() as c:
        items = c.snapshots(sandbox_id)
    if as_json:
        output.print_json(items)
        return
    rows = [[s["snapshotID"], ",".join(s.get("names") or []) or "-", s.get("sandboxID") or "-",
             s.get("templateID") or "-", output.ago(s.get("createdAt")),
             output.size(s.get("totalBytes")), output.size(s.get("storedBytes"))]
            for s in items]
    output.table(["SNAPSHOT ID", "NAME", "SANDBOX", "TEMPLATE", "CREATED", "SIZE", "STORED"],
                 rows)


@snapshot_app.command("tree")
def snapshot_tree(
    snapshot: Annotated[str | None, typer.Argument(
        help="Snapshot ID, prefix or name: its ancestors and what was made from it "
             "(default: every tree).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Snapshot lineage: template -> sandboxes -> snapshots -> sandboxes made from them
    (forks, creates) -> their snapshots; a sandbox's resets are shown on its line."""
    with Client() as c:
        if snapshot is None:
            data = c.json("GET", "/lineage")
        else:
            data = c.json("GET", f"/snapshots/{quote(c.resolve_snapshot(snapshot), safe='')}"
                                 "/lineage")
    if as_json:
        output.print_json(data)
        return
    if snapshot is None:
        for root in data["roots"]:
            output.out.print(output.lineage_tree(root))
        return
    trunk = output.lineage_tree(data["tree"], mark=True)
    for node in reversed(data["ancestors"]):  # each ancestor wraps what came of it
        wrapper = output.lineage_tree({**node, "children": []})
        wrapper.children.append(trunk)
        trunk = wrapper
    output.out.print(trunk)


@cli.command()
def diff(
    before: Annotated[str, typer.Argument(help="A snapshot (ID, prefix or name) or a "
                                               "running sandbox (ID or prefix).")],
    after: Annotated[str, typer.Argument(help="The same, to compare it with.")],
    text: Annotated[bool, typer.Option("--text", help="Unified diffs of changed text "
                                                      "files.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """What changed in the files from BEFORE to AFTER: + added, - removed, ~ changed."""
    with Client() as c:
        refs = [quote(_diff_ref(c, ref), safe="") for ref in (before, after)]
        data = c.json("POST", f"/snapshots/{refs[0]}/diff/{refs[1]}",
                      params={"text": "true"} if text else None)
    if as_json:
        output.print_json(data)
        return
    for mark, key in (("+", "added"), ("-", "removed"), ("~", "changed")):
        for item in data[key]:
            output.out.print(f"{mark} {item['path']}", markup=False)
    if data.get("truncated"):
        output.err.print("aenv: more changes than listed (the node lists 10,000 of each)")
    for patch in (data.get("diffs") or {}).values():
        output.out.print(patch, markup=False, end="")


def _diff_ref(c: Client, ref: str) -> str:
    """A running sandbox's full ID for a prefix of one, else the snapshot's."""
    try:
        return c.resolve(ref)
    except CliError:
        return c.resolve_snapshot(ref)


@snapshot_app.command("rm")
def snapshot_rm(
    snapshots: Annotated[list[str], typer.Argument(help="Snapshot IDs, prefixes or names.")],
) -> None:
    """Remove snapshots."""
    failed = 0
    with Client() as c:
        for ref in snapshots:
            try:
                snap = c.resolve_snapshot(ref)
                c.request("DELETE", f"/snapshots/{snap}")
                typer.echo(snap)
            except CliError as exc:
                failed += 1
                output.err.print(f"aenv: {ref}: {exc}", markup=False)
    if failed:
        raise typer.Exit(1)


__all__ = ["ApiError", "cli", "config_path"]


# -- files --------------------------------------------------------------------------

@cli.command()
def upload(
    sandbox: Annotated[str, typer.Argument(help="Sandbox ID or unique prefix.")],
    local: Annotated[Path, typer.Argument(help="A local file or directory.")],
    remote: Annotated[str, typer.Argument(help="Destination path in the sandbox.")],
) -> None:
    """Copy a file or directory (recursively) into a sandbox."""
    from .files import upload as copy_in

    with Client() as c:
        sbx = sdk_sandbox(c, c.resolve(sandbox))
    copy_in(sbx, local, remote)


@cli.command()
def download(
    sandbox: Annotated[str, typer.Argument(help="Sandbox ID or unique prefix.")],
    remote: Annotated[str, typer.Argument(help="A file or directory in the sandbox.")],
    local: Annotated[Path, typer.Argument(help="Local destination.")],
) -> None:
    """Copy a file or directory (recursively) out of a sandbox."""
    from .files import download as copy_out

    with Client() as c:
        sbx = sdk_sandbox(c, c.resolve(sandbox))
    copy_out(sbx, remote, local)
