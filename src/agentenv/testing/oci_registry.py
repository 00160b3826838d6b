"""A real OCI registry for tests (Debian's ``docker-registry``, distribution 2.x) and
the images tests push to it, built here from tar layers.

``RegistryServer`` runs the registry on a loopback port with its own config and
storage; with ``auth=True`` it trusts ``TokenServer``, a small token service
that checks basic credentials and issues the JWTs the registry verifies
against its root certificate bundle.
"""

from __future__ import annotations

import base64
import datetime
import gzip
import hashlib
import http.server
import io
import json
import os
import shutil
import subprocess
import tarfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jwt
import zstandard
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ..images.estargz_build import build_estargz
from ..images.manifest import TOC_DIGEST_ANNOTATION
from .ports import listening_port

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TYPES = {
    "tar": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- building images ----------------------------------------------------------------


@dataclass
class Entry:
    """One tar member: a file (data), a dir, a symlink or hard link (link), a device."""

    name: str
    data: bytes = b""
    type: bytes = tarfile.REGTYPE
    link: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    devmajor: int = 0
    devminor: int = 0


def tar_layer(entries: list[Entry]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type, info.mode, info.uid, info.gid = e.type, e.mode, e.uid, e.gid
            info.linkname = e.link
            info.mtime = 1_700_000_000
            info.devmajor, info.devminor = e.devmajor, e.devminor
            info.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape")
                                for k, v in e.xattrs.items()}
            if e.type == tarfile.REGTYPE:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            else:
                tar.addfile(info)
    return out.getvalue()


BUSYBOX = Path("/bin/busybox")  # busybox-static (scripts/setup-system.sh)
BUSYBOX_APPLETS = ("sh", "cat", "head", "wc", "md5sum", "ls", "echo", "true", "whoami")


def busybox_layer(extra: Sequence[Entry] = ()) -> bytes:
    """A minimal bootable rootfs as one layer (~1 MiB): static busybox, its applets and
    the users envd needs. envd brings its own runtime, so sandboxes start from it."""
    entries = [Entry(d + "/", type=tarfile.DIRTYPE, mode=0o755)
               for d in ("bin", "etc", "root", "proc", "dev", "home", "home/user", "opt")]
    entries += [Entry("tmp/", type=tarfile.DIRTYPE, mode=0o1777),
                Entry("bin/busybox", BUSYBOX.read_bytes(), mode=0o755)]
    entries += [Entry(f"bin/{a}", type=tarfile.SYMTYPE, link="busybox") for a in BUSYBOX_APPLETS]
    entries += [Entry("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"
                      b"user:x:1000:1000:user:/home/user:/bin/sh\n"),
                Entry("etc/group", b"root:x:0:\nuser:x:1000:\n"), *extra]
    return tar_layer(entries)


def tar_tree(root: Path, dest: Path) -> Path:
    """An uncompressed tar of a directory (numeric owners, xattrs), made once per path."""
    if not dest.exists():
        tmp = dest.with_suffix(".tmp")
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "--xattrs", "-cf", str(tmp),
                        "."], check=True)
        os.replace(tmp, dest)
    return dest


def compress(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data, compresslevel=1, mtime=0)
    if how == "zstd":
        return zstandard.ZstdCompressor(level=3).compress(data)
    return data


@dataclass
class Blob:
    data: bytes
    media_type: str = ""
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return digest_of(self.data)

    def descriptor(self, **extra: object) -> dict:
        out = {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data),
               **extra}
        if self.annotations:
            out["annotations"] = self.annotations
        return out


@dataclass
class TestImage:
    layers: list[Blob]
    config: Blob
    manifest: Blob
    diff_ids: list[str]

    @property
    def blobs(self) -> list[Blob]:
        return [*self.layers, self.config]


def build_image(tars: list[bytes], compression: list[str] | None = None,
                env: list[str] | None = None, cmd: list[str] | None = None,
                arch: str = "amd64", docker_types: bool = False,
                workdir: str = "/", user: str = "") -> TestImage:
    """An image of the given layer tars (bottom first), each compressed as asked."""
    compression = compression or ["gzip"] * len(tars)
    layers, diff_ids = [], []
    for t, c in zip(tars, compression, strict=True):
        if c == "estargz":  # a new tar (TOC and landmark added): its own diff ID
            out = io.BytesIO()
            built = build_estargz(io.BytesIO(t), out, level=1)
            layers.append(Blob(out.getvalue(), LAYER_TYPES["gzip"],
                               {TOC_DIGEST_ANNOTATION: built.toc_digest}))
            diff_ids.append(built.diff_id)
        else:
            layers.append(Blob(compress(t, c), LAYER_TYPES[c]))
            diff_ids.append(digest_of(t))
    if docker_types:
        for layer in layers:
            layer.media_type = "application/vnd.docker.image.rootfs.diff.tar.gzip"
    config, manifest = manifest_for([layer.descriptor() for layer in layers], diff_ids, env=env,
                                    cmd=cmd, arch=arch, docker_types=docker_types,
                                    workdir=workdir, user=user)
    return TestImage(layers, config, manifest, diff_ids)


def manifest_for(layers: list[dict], diff_ids: list[str], env: list[str] | None = None,
                 cmd: list[str] | None = None, arch: str = "amd64", docker_types: bool = False,
                 workdir: str = "/", user: str = "") -> tuple[Blob, Blob]:
    """The config and manifest of an image of these layer descriptors (bottom first)."""
    config = Blob(json.dumps({
        "architecture": arch, "os": "linux",
        "config": {"Env": env or [f"PATH={DEFAULT_PATH}"],
                   "Cmd": cmd or ["/bin/sh"], "WorkingDir": workdir, "User": user},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }).encode(), "application/vnd.docker.container.image.v1+json" if docker_types
        else OCI_CONFIG)
    manifest_type = ("application/vnd.docker.distribution.manifest.v2+json" if docker_types
                     else OCI_MANIFEST)
    manifest = Blob(json.dumps({
        "schemaVersion": 2, "mediaType": manifest_type, "config": config.descriptor(),
        "layers": layers,
    }).encode(), manifest_type)
    return config, manifest


def build_index(images: dict[str, TestImage]) -> Blob:
    """An image index; keys are architectures."""
    return Blob(json.dumps({
        "schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [img.manifest.descriptor(platform={"os": "linux", "architecture": arch})
                      for arch, img in images.items()],
    }).encode(), OCI_INDEX)


def write_oci_layout(directory: Path, image: TestImage, tag: str = "latest",
                     index: Blob | None = None, extra: Sequence[TestImage] = ()) -> Path:
    blobs = directory / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    for blob in [*image.blobs, image.manifest, *((index and [index]) or []),
                 *(b for img in extra for b in [*img.blobs, img.manifest])]:
        (blobs / blob.digest.split(":")[1]).write_bytes(blob.data)
    (directory / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    top = index or image.manifest
    (directory / "index.json").write_text(json.dumps({
        "schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [top.descriptor(annotations={
            "org.opencontainers.image.ref.name": tag})],
    }))
    return directory


def write_docker_archive(path: Path, tars: list[bytes], tag: str = "test:latest") -> Path:
    """What ``docker save`` writes: layer tars, the config, manifest.json."""
    image = build_image(tars, ["tar"] * len(tars))
    with tarfile.open(path, "w") as out:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
        names = []
        for i, t in enumerate(tars):
            names.append(f"layer{i}/layer.tar")
            add(names[-1], t)
        cfg = image.config.digest.split(":")[1] + ".json"
        add(cfg, image.config.data)
        add("manifest.json", json.dumps([{"Config": cfg, "RepoTags": [tag],
                                          "Layers": names}]).encode())
    return path


# -- token service ---------------------------------------------------------------------


class TokenServer:
    """Issues registry tokens (ES256 JWTs carrying their certificate in ``x5c``) to
    clients presenting the right basic credentials."""

    def __init__(self, directory: Path, service: str, username: str, password: str):
        self.service, self.issuer = service, "agentenv-test-issuer"
        self.username, self.password = username, password
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentenv test tokens")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(hours=1))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .sign(self.key, hashes.SHA256()))
        self.bundle = directory / "token-ca.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.issued = 0
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def token(self, scope: str) -> str:
        now = int(time.time())
        access = []
        if scope:
            kind, name, actions = scope.split(":", 2)
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        x5c = [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]
        self.issued += 1
        return jwt.encode({"iss": self.issuer, "sub": self.username, "aud": self.service,
                           "exp": now + 300, "nbf": now - 10, "iat": now,
                           "jti": os.urandom(8).hex(), "access": access},
                          self.key, algorithm="ES256", headers={"x5c": x5c})

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                expected = base64.b64encode(
                    f"{server.username}:{server.password}".encode()).decode()
                if self.headers.get("Authorization") != f"Basic {expected}":
                    self.send_response(401)
                    self.end_headers()
                    return
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                body = json.dumps({"token": server.token(query.get("scope", [""])[0])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- the registry --------------------------------------------------------------------------


class RegistryServer:
    """``docker-registry`` on 127.0.0.1:<free port>, storage under ``directory``."""

    def __init__(self, directory: Path, auth: bool = False, username: str = "tester",
                 password: str = "s3cret-pass", access_log: bool = False):
        self.directory = directory
        # Log every response (``blob_bytes_sent`` counts what clients read of blobs).
        self.access_log = access_log
        directory.mkdir(parents=True, exist_ok=True)
        # Known once it listens (it binds port 0 itself: agentenv.testing.ports).
        self.port = 0
        self.username, self.password = username, password
        self.tokens = (TokenServer(directory, "agentenv-test-registry", username, password)
                       if auth else None)
        self.proc: subprocess.Popen | None = None
        self._pushed: dict[str, str] = {}  # blob digest -> a repository that has it

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self) -> RegistryServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        auth = ""
        if self.tokens is not None:
            self.tokens.start()
            auth = (f"auth:\n  token:\n    realm: {self.tokens.realm}\n"
                    f"    service: {self.tokens.service}\n    issuer: {self.tokens.issuer}\n"
                    f"    rootcertbundle: {self.tokens.bundle}\n")
        config = self.directory / "config.yml"
        config.write_text(
            f"version: 0.1\nlog:\n  level: {'info' if self.access_log else 'warn'}\n"
            "  formatter: json\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.directory / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n{auth}")  # 0 the first time
        log = open(self.directory / "registry.log", "ab")
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=log,
                                     stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()  # a registry that failed to start is not left running
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        try:
            self.port = listening_port(self.proc)
        except RuntimeError as exc:
            log_text = (self.directory / "registry.log").read_text()
            raise RuntimeError(f"registry: {exc}: {log_text}") from exc
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                log_text = (self.directory / "registry.log").read_text()
                raise RuntimeError(f"registry exited: {log_text}")
            try:
                httpx.get(f"{self.url}/v2/", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("registry did not start")

    def blob_bytes_sent(self, repo: str = "") -> int:
        """Bytes of blobs (of ``repo``, or any) the registry has sent so far, from its
        access log (``access_log=True``)."""
        sent = 0
        for line in (self.directory / "registry.log").read_text(errors="replace").splitlines():
            if not line.startswith("{") or '"response completed"' not in line:
                continue
            doc = json.loads(line)
            uri = str(doc.get("http.request.uri", ""))
            if doc.get("http.request.method") == "GET" and "/blobs/" in uri and \
                    uri.startswith(f"/v2/{repo}"):
                sent += int(doc.get("http.response.written", 0))
        return sent

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.tokens is not None:
            self.tokens.stop()

    def __enter__(self) -> RegistryServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _client(self, repo: str) -> httpx.Client:
        headers = {}
        if self.tokens is not None:
            headers["Authorization"] = "Bearer " + self.tokens.token(
                f"repository:{repo}:pull,push")
        return httpx.Client(base_url=f"{self.url}/v2/{repo}", headers=headers, timeout=120)

    def push_blob(self, repo: str, blob: Blob) -> None:
        self._upload(repo, blob.digest, blob.data, len(blob.data))

    def push_file(self, repo: str, path: Path, digest: str) -> None:
        """A blob too large to hold in memory, streamed from ``path``."""
        def body() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while piece := f.read(1 << 20):
                    yield piece

        self._upload(repo, digest, body(), path.stat().st_size)

    def _upload(self, repo: str, digest: str, content: bytes | Iterator[bytes],
                size: int) -> None:
        """One monolithic upload, unless the registry has the blob."""
        with self._client(repo) as c:
            if c.head(f"/blobs/{digest}").status_code == 200:
                return
            # In another repository already: mounted from there (201), not sent again.
            source = self._pushed.get(digest)
            if source is not None and source != repo and c.post(
                    "/blobs/uploads/", params={"mount": digest, "from": source}
            ).status_code == 201:
                return
            start = c.post("/blobs/uploads/")
            start.raise_for_status()
            location = start.headers["location"]
            sep = "&" if "?" in location else "?"
            done = c.put(f"{location}{sep}digest={digest}", content=content,
                         headers={"Content-Type": "application/octet-stream",
                                  "Content-Length": str(size)})
            done.raise_for_status()
        self._pushed[digest] = repo

    def push_manifest(self, repo: str, reference: str, manifest: Blob) -> None:
        with self._client(repo) as c:
            resp = c.put(f"/manifests/{reference}", content=manifest.data,
                         headers={"Content-Type": manifest.media_type})
            resp.raise_for_status()

    def push(self, repo: str, tag: str, image: TestImage) -> str:
        for blob in image.blobs:
            self.push_blob(repo, blob)
        self.push_manifest(repo, tag, image.manifest)
        return f"{self.host}/{repo}:{tag}"

    def push_index(self, repo: str, tag: str, images: dict[str, TestImage]) -> str:
        for image in images.values():
            for blob in image.blobs:
                self.push_blob(repo, blob)
            self.push_manifest(repo, image.manifest.digest, image.manifest)
        self.push_manifest(repo, tag, build_index(images))
        return f"{self.host}/{repo}:{tag}"
