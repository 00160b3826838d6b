"""oss: a repository in any S3-compatible object store, through boto3.

A PUT of an object is atomic in S3 (visible whole or not at all), so chunks and
manifests are single PUTs (chunks are at most 256 KiB before compression). An
exclusive write (a manifest, a lock) is a conditional PUT (``If-None-Match: *``).

Layout under ``<prefix>``: ``chunks/<d[:2]>/<digest>``, ``manifests/``,
``aliases/``, ``leases/``, ``locks/``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import boto3
import botocore.config
import botocore.exceptions

from agentenv.snapshot.errors import (
    ObjectMissing,
    RepositoryUnavailable,
    SnapshotConfigError,
    SnapshotError,
    SnapshotExists,
)
from agentenv.snapshot.manifest import valid_digest
from agentenv.snapshot.repository import RepositoryConfig

_KEY_DIRS = ("manifests", "aliases", "leases", "locks", "templates", "template-aliases",
             "image-layers", "image-prefetch", "image-used")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_UNREACHABLE = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
)


def _read_secret(inline: str | None, path: Path | None, name: str) -> str | None:
    if inline:
        return inline
    if path is None:
        return None
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise SnapshotConfigError(f"cannot read {name} file {path}: {exc.strerror}") from exc


class S3Repository:
    def __init__(self, cfg: RepositoryConfig) -> None:
        if not cfg.bucket:
            raise SnapshotConfigError("oss repository needs a 'bucket'")
        if not cfg.region:
            raise SnapshotConfigError(
                "oss repository needs an explicit 'region' (for example 'us-east-1'); "
                "it is not guessed from the environment")
        key_id = _read_secret(cfg.access_key_id, cfg.access_key_id_file, "access_key_id")
        secret = _read_secret(cfg.secret_access_key, cfg.secret_access_key_file,
                              "secret_access_key")
        if bool(key_id) != bool(secret):
            raise SnapshotConfigError(
                "oss repository: give both access_key_id and secret_access_key, or neither")
        self.bucket = cfg.bucket
        prefix = cfg.prefix.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        endpoint = cfg.endpoint_url or "aws"
        self.description = f"oss:{endpoint}/{self.bucket}/{self.prefix}"
        style = cfg.addressing_style or ("path" if cfg.endpoint_url else "auto")
        config = botocore.config.Config(
            region_name=cfg.region,
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
            max_pool_connections=cfg.max_connections,
            s3={"addressing_style": style},
        )
        session = boto3.session.Session()
        try:
            self._s3 = session.client(
                "s3", endpoint_url=cfg.endpoint_url, config=config,
                aws_access_key_id=key_id, aws_secret_access_key=secret,
                aws_session_token=cfg.session_token)
        except (ValueError, botocore.exceptions.BotoCoreError) as exc:
            raise SnapshotConfigError(f"oss repository: {exc}") from exc

    # -- helpers ----------------------------------------------------------------
    def _chunk_key(self, digest: str) -> str:
        if not valid_digest(digest):
            raise SnapshotError(f"invalid chunk digest {digest!r}")
        return f"{self.prefix}chunks/{digest[:2]}/{digest}"

    def _key(self, key: str) -> str:
        top, _, name = key.partition("/")
        if top not in _KEY_DIRS or not name or "/" in name:
            raise SnapshotError(f"invalid repository key {key!r}")
        return f"{self.prefix}{key}"

    def _call(self, what: str, fn, /, **kwargs):
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except _UNREACHABLE as exc:
            raise RepositoryUnavailable(f"{self.description} is unreachable ({what}): {exc}") \
                from exc
        except botocore.exceptions.ClientError as exc:
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _NOT_FOUND or status == 404:
                if code == "NoSuchBucket":
                    raise RepositoryUnavailable(
                        f"bucket {self.bucket!r} does not exist at {self.description}") from exc
                raise ObjectMissing(f"{what}: not in {self.description}") from exc
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                raise SnapshotExists(f"{what} already exists") from exc
            raise RepositoryUnavailable(
                f"{self.description} refused {what}: {code or status} "
                f"{err.get('Message', '')}".rstrip()) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise RepositoryUnavailable(f"{self.description} failed ({what}): {exc}") from exc

    # -- chunks -----------------------------------------------------------------
    def has_chunk(self, digest: str) -> bool:
        try:
            self._call(f"head chunk {digest}", self._s3.head_object, Key=self._chunk_key(digest))
            return True
        except ObjectMissing:
            return False

    def put_chunk(self, digest: str, blob: bytes) -> None:
        self._call(f"put chunk {digest}", self._s3.put_object, Key=self._chunk_key(digest),
                   Body=blob)

    def get_chunk(self, digest: str) -> bytes:
        resp = self._call(f"get chunk {digest}", self._s3.get_object,
                          Key=self._chunk_key(digest))
        try:
            return resp["Body"].read()
        except _UNREACHABLE as exc:
            raise RepositoryUnavailable(f"{self.description}: reading chunk {digest}: {exc}") \
                from exc

    def _list(self, prefix: str) -> Iterator[dict]:
        token = None
        while True:
            kwargs = {"Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            resp = self._call(f"list {prefix}", self._s3.list_objects_v2, **kwargs)
            yield from resp.get("Contents", [])
            if not resp.get("IsTruncated"):
                return
            token = resp.get("NextContinuationToken")

    def list_chunks(self) -> Iterator[tuple[str, int]]:
        for obj in self._list(f"{self.prefix}chunks/"):
            name = obj["Key"].rsplit("/", 1)[-1]
            if valid_digest(name):
                yield name, int(obj.get("Size", 0))

    def delete_chunks(self, digests: Iterable[str]) -> int:
        keys = [self._chunk_key(d) for d in digests]
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            resp = self._call("delete chunks", self._s3.delete_objects,
                              Delete={"Objects": batch, "Quiet": True})
            errors = resp.get("Errors") or []
            if errors:
                raise RepositoryUnavailable(
                    f"{self.description} refused to delete {len(errors)} chunks: "
                    f"{errors[0].get('Code')} {errors[0].get('Message', '')}")
        return len(keys)

    # -- named objects ------------------------------------------------------------
    def put_object(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        kwargs = {"IfNoneMatch": "*"} if exclusive else {}
        self._call(f"put {key}", self._s3.put_object, Key=self._key(key), Body=data, **kwargs)

    def get_object(self, key: str) -> bytes:
        resp = self._call(f"get {key}", self._s3.get_object, Key=self._key(key))
        try:
            return resp["Body"].read()
        except _UNREACHABLE as exc:
            raise RepositoryUnavailable(f"{self.description}: reading {key}: {exc}") from exc

    def delete_object(self, key: str) -> None:
        try:
            self._call(f"delete {key}", self._s3.delete_object, Key=self._key(key))
        except ObjectMissing:
            return

    def list_objects(self, prefix: str) -> list[str]:
        top = prefix.partition("/")[0]
        if top not in _KEY_DIRS:
            raise SnapshotError(f"invalid repository prefix {prefix!r}")
        n = len(self.prefix)
        return sorted(obj["Key"][n:] for obj in self._list(f"{self.prefix}{prefix}"))

    def close(self) -> None:
        self._s3.close()
