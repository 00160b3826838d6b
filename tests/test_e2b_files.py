"""Files through the official e2b SDK (Python, unchanged) against a node."""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path

import httpx
import pytest
from e2b import FileType, InvalidArgumentException, NotFoundException, Sandbox
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

from agentenv.testing import Node
from sandbox_helpers import envd_processes

MIB = 1 << 20


@pytest.fixture(scope="module")
def sbx(node: Node):
    sandbox = Sandbox.create(template="base", timeout=300)
    yield sandbox
    sandbox.kill()


def test_write_and_read_text_bytes_stream(sbx: Sandbox) -> None:
    info = sbx.files.write("/home/user/t/hello.txt", "héllo\nworld\n")
    assert info.path == "/home/user/t/hello.txt" and info.name == "hello.txt"
    assert info.type == FileType.FILE
    assert sbx.files.read("/home/user/t/hello.txt") == "héllo\nworld\n"
    assert sbx.files.read("/home/user/t/hello.txt", format="bytes") == "héllo\nworld\n".encode()
    streamed = b"".join(sbx.files.read("/home/user/t/hello.txt", format="stream"))
    assert streamed == "héllo\nworld\n".encode()
    # relative paths are the user's home
    assert sbx.files.read("t/hello.txt") == "héllo\nworld\n"


def test_write_bytes_and_file_object(sbx: Sandbox) -> None:
    blob = bytes(range(256)) * 100
    sbx.files.write("/home/user/t/blob.bin", blob)
    assert bytes(sbx.files.read("/home/user/t/blob.bin", format="bytes")) == blob
    sbx.files.write("/home/user/t/fileobj.bin", io.BytesIO(b"from a file object"))
    assert sbx.files.read("/home/user/t/fileobj.bin") == "from a file object"
    assert sbx.commands.run("stat -c %U:%s /home/user/t/blob.bin").stdout == f"user:{len(blob)}\n"


def test_write_files_at_once(sbx: Sandbox) -> None:
    infos = sbx.files.write_files([
        {"path": "/home/user/many/a.txt", "data": "A"},
        {"path": "/home/user/many/sub/b.bin", "data": b"\x00B"},
        {"path": "/home/user/many/c.txt", "data": io.BytesIO(b"C")},
    ])
    assert sorted(i.path for i in infos) == [
        "/home/user/many/a.txt", "/home/user/many/c.txt", "/home/user/many/sub/b.bin"]
    assert sbx.files.read("/home/user/many/sub/b.bin", format="bytes") == b"\x00B"
    assert sbx.files.read("/home/user/many/c.txt") == "C"


def test_list_with_depth(sbx: Sandbox) -> None:
    sbx.files.write_files([
        {"path": "/home/user/tree/top.txt", "data": "1"},
        {"path": "/home/user/tree/d1/mid.txt", "data": "2"},
        {"path": "/home/user/tree/d1/d2/deep.txt", "data": "3"},
    ])
    shallow = {e.path for e in sbx.files.list("/home/user/tree")}
    assert shallow == {"/home/user/tree/top.txt", "/home/user/tree/d1"}
    deeper = {e.path for e in sbx.files.list("/home/user/tree", depth=2)}
    assert deeper == shallow | {"/home/user/tree/d1/mid.txt", "/home/user/tree/d1/d2"}
    deepest = {e.path for e in sbx.files.list("/home/user/tree", depth=3)}
    assert "/home/user/tree/d1/d2/deep.txt" in deepest
    kinds = {e.name: e.type for e in sbx.files.list("/home/user/tree")}
    assert kinds == {"top.txt": FileType.FILE, "d1": FileType.DIR}


def test_exists_get_info_make_dir_rename_remove(sbx: Sandbox) -> None:
    assert not sbx.files.exists("/home/user/ops")
    assert sbx.files.make_dir("/home/user/ops/inner") is True
    assert sbx.files.make_dir("/home/user/ops/inner") is False  # already there
    assert sbx.files.exists("/home/user/ops/inner")
    sbx.files.write("/home/user/ops/inner/f.txt", "12345")
    info = sbx.files.get_info("/home/user/ops/inner/f.txt")
    assert (info.name, info.type, info.size, info.owner) == ("f.txt", FileType.FILE, 5, "user")
    assert info.permissions.startswith("-rw")
    dir_info = sbx.files.get_info("/home/user/ops/inner")
    assert dir_info.type == FileType.DIR

    moved = sbx.files.rename("/home/user/ops/inner/f.txt", "/home/user/ops/g.txt")
    assert moved.path == "/home/user/ops/g.txt"
    assert not sbx.files.exists("/home/user/ops/inner/f.txt")
    assert sbx.files.read("/home/user/ops/g.txt") == "12345"

    sbx.files.remove("/home/user/ops/g.txt")
    assert not sbx.files.exists("/home/user/ops/g.txt")
    sbx.files.remove("/home/user/ops")  # a directory, recursively
    assert not sbx.files.exists("/home/user/ops/inner")
    with pytest.raises(NotFoundException):
        sbx.files.read("/home/user/ops/nothing-here")
    with pytest.raises(NotFoundException):
        sbx.files.get_info("/home/user/ops/nothing-here")


def test_watch_dir_events(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.files.write("/home/user/watched/new.txt", "x")
        sbx.commands.run("echo more >> /home/user/watched/new.txt")
        sbx.files.remove("/home/user/watched/new.txt")
        events: list = []
        end = time.monotonic() + 10
        while time.monotonic() < end:
            events += handle.get_new_events()
            if any(e.type == FilesystemEventType.REMOVE for e in events):
                break
            time.sleep(0.1)
        kinds = [(e.type, e.name) for e in events]
        for kind in (FilesystemEventType.CREATE, FilesystemEventType.WRITE,
                     FilesystemEventType.REMOVE):
            assert (kind, "new.txt") in kinds, kinds
    finally:
        handle.stop()


def test_watch_dir_recursive(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/rwatch/sub")
    handle = sbx.files.watch_dir("/home/user/rwatch", recursive=True)
    try:
        sbx.files.write("/home/user/rwatch/sub/deep.txt", "x")
        events: list = []
        end = time.monotonic() + 10
        while time.monotonic() < end and not events:
            events += handle.get_new_events()
            time.sleep(0.1)
        assert any(e.name.endswith("deep.txt") for e in events), events
    finally:
        handle.stop()


def test_download_and_upload_urls_are_signed(node: Node, sbx: Sandbox) -> None:
    sbx.files.write("/home/user/shared.txt", "download me")
    url = sbx.download_url("/home/user/shared.txt")
    assert "signature=" in url
    # A plain HTTP client with nothing but the URL (no key, no headers).
    r = httpx.get(url)
    assert r.status_code == 200 and r.text == "download me"

    up = sbx.upload_url("/home/user/uploaded.txt")
    r = httpx.post(up, files={"file": ("uploaded.txt", b"uploaded through a URL")})
    assert r.status_code == 200, r.text
    assert sbx.files.read("/home/user/uploaded.txt") == "uploaded through a URL"

    # an expiring signature works until it expires
    url = sbx.download_url("/home/user/shared.txt", use_signature_expiration=60)
    assert "signature_expiration=" in url and httpx.get(url).text == "download me"

    # tampering with the path, or using a read URL to write, is refused
    r = httpx.get(url.replace("shared.txt", "uploaded.txt"))
    assert r.status_code == 401 and r.json()["code"] == 401
    r = httpx.post(sbx.download_url("/home/user/x.txt"), files={"file": ("x", b"x")})
    assert r.status_code == 401
    assert not sbx.files.exists("/home/user/x.txt")


def test_download_url_as_other_user(sbx: Sandbox) -> None:
    sbx.commands.run("echo secret > /root/only-root.txt && chmod 600 /root/only-root.txt",
                     user="root")
    assert httpx.get(sbx.download_url("/root/only-root.txt", user="root")).text == "secret\n"
    up = sbx.upload_url("/root/from-url.txt", user="root")
    assert httpx.post(up, files={"file": ("f", b"root's")}).status_code == 200
    assert sbx.commands.run("stat -c %U /root/from-url.txt", user="root").stdout == "root\n"


def _rss(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def test_large_file_streams_through_the_node(node: Node, sbx: Sandbox) -> None:
    """150 MiB up and down through the node's proxy; the node never holds it whole."""
    size = 150 * MIB
    chunk = hashlib.sha256(b"seed").digest() * (MIB // 32)

    class Source(io.RawIOBase):
        """A readable file object that produces `size` bytes on the fly."""

        def __init__(self) -> None:
            self.left = size
            self.digest = hashlib.sha256()

        def readable(self) -> bool:
            return True

        def readinto(self, buf) -> int:
            n = min(len(buf), self.left, len(chunk))
            buf[:n] = chunk[:n]
            self.digest.update(chunk[:n])
            self.left -= n
            return n

    pid = node.proc.pid
    assert node.proc is not None
    # Reset the node's peak-RSS mark, so the peak below is this transfer's.
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _rss(pid, "VmRSS")

    source = Source()
    t0 = time.monotonic()
    sbx.files.write("/home/user/big.bin", io.BufferedReader(source, buffer_size=MIB))
    up_s = time.monotonic() - t0
    assert sbx.files.get_info("/home/user/big.bin").size == size

    down = hashlib.sha256()
    got = 0
    t0 = time.monotonic()
    for part in sbx.files.read("/home/user/big.bin", format="stream"):
        down.update(part)
        got += len(part)
    down_s = time.monotonic() - t0
    peak = _rss(pid, "VmHWM")

    assert got == size
    assert down.hexdigest() == source.digest.hexdigest()
    grew = peak - before
    print(f"150 MiB up {up_s:.1f}s, down {down_s:.1f}s; node RSS {before / MIB:.0f} MiB, "
          f"peak +{grew / MIB:.1f} MiB")
    assert grew < 48 * MIB, f"node RSS grew {grew / MIB:.0f} MiB while moving 150 MiB"
    sbx.files.remove("/home/user/big.bin")


def test_removing_a_missing_path_is_a_no_op(sbx: Sandbox) -> None:
    """Issue 14.7: as E2B's envd (rm -rf): no FileNotFoundException. And as root, as
    E2B's Remove (services/filesystem/remove.go, os.RemoveAll) is: a file in a
    directory the user may not enter goes too (the strict mode refuses it:
    test_security_envd_users)."""
    sbx.files.remove("/home/user/never-was-here.txt")
    sbx.files.remove("/home/user/no/such/dir")
    sbx.commands.run("mkdir -p /root/closed && touch /root/closed/f", user="root")
    sbx.files.remove("/root/closed/f", user="user")
    assert not sbx.files.exists("/root/closed/f", user="root")


def test_signed_upload_edge_cases_as_e2b(sbx: Sandbox) -> None:
    """Issue 14.11: a part named "file" without a filename goes to the URL's path; an
    expired signature is a 401 saying so."""
    up = sbx.upload_url("/home/user/no-filename.txt")
    body = (b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nno filename\r\n"
            b"--b--\r\n")
    r = httpx.post(up, content=body, headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 200, r.text
    assert sbx.files.read("/home/user/no-filename.txt") == "no filename"

    url = sbx.download_url("/home/user/no-filename.txt", use_signature_expiration=1)
    time.sleep(2.1)
    r = httpx.get(url)
    assert r.status_code == 401 and "signature is already expired" in r.text, r.text
    assert httpx.get(sbx.download_url("/home/user/no-filename.txt")).text == "no filename"


def test_overwrite_replaces_file_metadata(sbx: Sandbox) -> None:
    """Issue 14.8: as E2B's envd, each upload replaces a file's user-defined metadata
    (``user.e2b.*`` xattrs from ``X-Metadata-*`` headers): a write without metadata
    clears what an earlier write set, a write with other keys drops the old ones, and
    a key is lowercased. Metadata E2B's envd refuses is a 400 naming it."""
    path = "/home/user/meta/m.txt"
    info = sbx.files.write(path, "one", metadata={"Owner": "alice", "stage": "raw"})
    assert info.metadata == {"owner": "alice", "stage": "raw"}
    assert sbx.files.get_info(path).metadata == {"owner": "alice", "stage": "raw"}
    info = sbx.files.write(path, "two", metadata={"stage": "clean"})
    assert info.metadata == {"stage": "clean"}
    assert sbx.files.get_info(path).metadata == {"stage": "clean"}
    info = sbx.files.write(path, "three")
    assert info.metadata is None
    assert sbx.files.get_info(path).metadata is None
    assert sbx.files.read(path) == "three"
    # the multi-file write (multipart) replaces it too, on every file it writes
    sbx.files.write(path, "four", metadata={"a": "1"})
    infos = sbx.files.write_files([{"path": path, "data": "five"},
                                   {"path": "/home/user/meta/n.txt", "data": "n"}])
    assert [i.metadata for i in infos] == [None, None]
    assert sbx.files.get_info(path).metadata is None
    # over E2B's 4096-byte budget: refused before the file is touched
    with pytest.raises(InvalidArgumentException, match="metadata"):
        sbx.files.write(path, "six", metadata={"big": "x" * 5000})
    assert sbx.files.read(path) == "five"


def test_read_of_proc_files_returns_their_content(node: Node, sbx: Sandbox) -> None:
    # procfs files report size 0: the content is made on read, so envd reads to EOF.
    uptime = sbx.files.read("/proc/uptime")
    assert uptime.endswith("\n") and len(uptime.split()) == 2, repr(uptime)
    assert float(uptime.split()[0]) > 0
    boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id")
    assert boot_id == sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
    assert len(boot_id.strip()) == 36
    raw = sbx.files.read("/proc/self/status", format="bytes")
    assert b"\nUid:" in raw
    # Through a signed URL too (the same GET /files).
    r = httpx.get(sbx.download_url("/proc/uptime"), timeout=60)
    assert r.status_code == 200 and len(r.text.split()) == 2, r.text


# -- writes as E2B's envd does them (issue 33, item 1) ----------------------------------
def _stat(sbx: Sandbox, path: str) -> str:
    return sbx.commands.run(f"stat -c '%U %a' {path}", user="root").stdout.strip()


def test_default_user_writes_where_root_owns_the_tree(sbx: Sandbox) -> None:
    """E2B's envd writes as root: each missing parent is made 0755 and chowned to the
    user (permissions.EnsureDirs), an existing file is chowned to the user before it
    is truncated (api/upload.go processFile); MakeDir and Move ensure theirs alike."""
    sbx.files.write("/solution/solve.sh", "#!/bin/sh\necho solved\n")
    assert _stat(sbx, "/solution") == "user 755"
    assert _stat(sbx, "/solution/solve.sh") == "user 644"
    # a file root wrote (a command's log), uploaded over as the default user
    sbx.commands.run("mkdir -p /logs && echo root > /logs/out.txt && chmod 600 /logs/out.txt",
                     user="root")
    sbx.files.write("/logs/out.txt", "user\n")
    assert sbx.files.read("/logs/out.txt") == "user\n"
    assert _stat(sbx, "/logs/out.txt") == "user 600"
    # ... and read back as E2B does (as root) though the user's shell may not
    sbx.commands.run("echo secret > /logs/root.txt && chmod 600 /logs/root.txt", user="root")
    assert sbx.files.read("/logs/root.txt") == "secret\n"
    # E2B's JS test "write multiple files" writes to /0/multi_test_file0.txt
    infos = sbx.files.write_files([{"path": f"/0/multi_test_file{i}.txt", "data": str(i)}
                                   for i in range(2)])
    assert [i.path for i in infos] == ["/0/multi_test_file0.txt", "/0/multi_test_file1.txt"]
    assert _stat(sbx, "/0") == "user 755"
    assert sbx.files.make_dir("/opt/made/deep")
    assert _stat(sbx, "/opt/made") == "user 755" and _stat(sbx, "/opt") == "root 755"
    sbx.files.rename("/solution/solve.sh", "/srv/moved/solve.sh")
    assert _stat(sbx, "/srv/moved") == "user 755"
    assert sbx.commands.run("sh /srv/moved/solve.sh", user="root").stdout == "solved\n"


def test_a_write_reports_create_chmod_write_every_time(sbx: Sandbox) -> None:
    """E2B's test_watch_iterated: three events right after one write into a watched
    directory. Its envd creates (CREATE), chowns (CHMOD), then writes (WRITE)."""
    sbx.files.make_dir("/home/user/watch3")
    handle = sbx.files.watch_dir("/home/user/watch3")
    try:
        for i in range(8):
            sbx.files.write(f"/home/user/watch3/f{i}.txt", "x" * (1 + 300_000 * (i % 2)))
            got = [(e.type, e.name) for e in handle.get_new_events()]
            assert got == [(t, f"f{i}.txt") for t in (
                FilesystemEventType.CREATE, FilesystemEventType.CHMOD,
                FilesystemEventType.WRITE)], (i, got)
        sbx.files.write("/home/user/watch3/f0.txt", "again")  # over an existing file
        got = [(e.type, e.name) for e in handle.get_new_events()]
        assert got == [(FilesystemEventType.CHMOD, "f0.txt"),
                       (FilesystemEventType.WRITE, "f0.txt")], got
    finally:
        handle.stop()
    entry_handle = sbx.files.watch_dir("/home/user/watch3", include_entry=True)
    try:
        sbx.files.write("/home/user/watch3/f1.txt", "modified")
        writes = [e for e in entry_handle.get_new_events()
                  if e.type == FilesystemEventType.WRITE]
        assert len(writes) == 1 and writes[0].entry is not None
        assert writes[0].entry.path == "/home/user/watch3/f1.txt"
    finally:
        entry_handle.stop()



def test_quick_file_operations_fork_no_worker_and_a_fifo_does_not_hang_envd(
        sbx: Sandbox) -> None:
    """The default mode's writes, reads, stats and mkdirs are envd's own (issue 27): a
    file step after a think gap no longer forks a file worker, ~250 ms under load. Done
    on envd's event loop, a FIFO or a device at the path must fail, not block it."""
    sbx.files.remove("/home/user/quick")  # a worker's operation: one may be up now
    for pid in envd_processes(sbx):
        if pid != "1":
            sbx.commands.run(f"kill -9 {pid} || true", user="root")
    assert envd_processes(sbx) == ["1"]
    sbx.files.write("/home/user/quick/a/b.txt", "x")  # its parents made as well
    assert sbx.files.read("/home/user/quick/a/b.txt") == "x"
    assert sbx.files.exists("/home/user/quick/a")
    assert sbx.files.get_info("/home/user/quick/a/b.txt").owner == "user"
    assert sbx.files.make_dir("/home/user/quick/c")
    sbx.files.write_files([{"path": "/home/user/quick/d.txt", "data": "y"}])
    assert envd_processes(sbx) == ["1"]
    # Still the user's, as E2B's envd makes them: parents, file and directory alike.
    owners = sbx.commands.run("stat -c '%U' /home/user/quick /home/user/quick/a "
                              "/home/user/quick/a/b.txt /home/user/quick/c").stdout
    assert owners.split() == ["user"] * 4, owners

    sbx.commands.run("mkfifo /home/user/quick/pipe")
    t0 = time.monotonic()
    with pytest.raises(InvalidArgumentException, match="not a regular file"):
        sbx.files.read("/home/user/quick/pipe", request_timeout=15)
    with pytest.raises(InvalidArgumentException, match="not a regular file"):
        sbx.files.write("/home/user/quick/pipe", "x", request_timeout=15)
    with pytest.raises(InvalidArgumentException, match="not a regular file"):
        sbx.files.read("/dev/zero", request_timeout=15)
    assert time.monotonic() - t0 < 10
    assert sbx.commands.run("echo alive", timeout=15).stdout == "alive\n"
    sbx.files.remove("/home/user/quick")
