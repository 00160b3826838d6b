"""Repository configuration: plain dicts, the required region, credentials from
files, secrets never shown; S3 layout under a prefix on a real S3 server."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agentenv.snapshot import (
    RepositoryConfig,
    RepositoryUnavailable,
    SnapshotConfigError,
    open_repository,
)
from agentenv.snapshot.posix import PosixRepository
from test_snapshot_store import (  # noqa: F401  (fixtures)
    S3Server,
    fixture_s3_server,
    make_store,
    read_tree,
    stage,
)


def test_missing_region_is_a_config_error(s3_server: S3Server) -> None:
    config = s3_server.config()
    del config["region"]
    with pytest.raises(SnapshotConfigError, match="explicit 'region'"):
        open_repository(config)
    with pytest.raises(SnapshotConfigError, match="region"):
        open_repository({**config, "region": ""})


def test_other_config_errors() -> None:
    with pytest.raises(SnapshotConfigError, match="unknown repository backend"):
        open_repository({"backend": "ftp"})
    with pytest.raises(SnapshotConfigError, match="needs a 'path'"):
        open_repository({"backend": "posix_fs"})
    with pytest.raises(SnapshotConfigError, match="needs a 'bucket'"):
        open_repository({"backend": "oss", "region": "us-east-1"})
    with pytest.raises(SnapshotConfigError, match="unknown repository config keys: colour"):
        open_repository({"backend": "posix_fs", "path": "/tmp/x", "colour": "red"})
    with pytest.raises(SnapshotConfigError, match="both access_key_id and secret"):
        open_repository({"backend": "oss", "bucket": "b", "region": "r",
                         "access_key_id": "only-the-id"})
    with pytest.raises(SnapshotConfigError, match="cannot read secret_access_key file"):
        open_repository({"backend": "oss", "bucket": "b", "region": "r",
                         "access_key_id": "a", "secret_access_key_file": "/nonexistent/k"})


def test_default_backend_is_posix_fs(tmp_path: Path) -> None:
    repo = open_repository({"path": str(tmp_path / "r")})
    assert isinstance(repo, PosixRepository)
    cfg = RepositoryConfig(path=tmp_path / "r2")
    assert isinstance(open_repository(cfg), PosixRepository)


def test_credentials_from_files_and_no_secret_in_repr_or_logs(
        s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "id").write_text("test\n")
    (tmp_path / "secret").write_text("s3cr3t-value\n")
    config = s3_server.config()
    del config["access_key_id"], config["secret_access_key"]
    config.update(access_key_id_file=str(tmp_path / "id"),
                  secret_access_key_file=str(tmp_path / "secret"))
    caplog.set_level(logging.DEBUG, logger="agentenv.snapshot")
    store = make_store(config, tmp_path / "node")
    files = {"a": os.urandom(300_000)}
    store.commit("cred", stage(store, "cred", files), {})
    store.evict("cred")
    assert read_tree(store.materialize("cred")) == files
    inline = RepositoryConfig.from_dict({**s3_server.config(), "secret_access_key": "s3cr3t-value",
                                         "session_token": "tok3n-value"})
    for text in (repr(inline), str(inline), store.repo.description, caplog.text):
        assert "s3cr3t-value" not in text and "tok3n-value" not in text
    assert "***" in repr(inline)


def test_layout_under_prefix(s3_server: S3Server, tmp_path: Path) -> None:
    bucket = s3_server.new_bucket()
    store = make_store(s3_server.config(bucket=bucket, prefix="/team/a/"), tmp_path / "n")
    store.commit("lay", stage(store, "lay", {"a": os.urandom(100_000)}), {}, alias="named")
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert all(k.startswith("team/a/") for k in keys)
    assert "team/a/manifests/lay.json" in keys and "team/a/aliases/named" in keys
    assert any(k.startswith("team/a/chunks/") for k in keys)
    # A second repository in the same bucket under another prefix sees nothing of it.
    other = make_store(s3_server.config(bucket=bucket, prefix="team/b"), tmp_path / "m")
    assert other.list() == []


def test_missing_bucket_or_bad_credentials_are_clear(s3_server: S3Server, tmp_path: Path) -> None:
    store = make_store(s3_server.config(bucket="no-such-bucket-here"), tmp_path / "n")
    with pytest.raises(RepositoryUnavailable, match="no-such-bucket-here"):
        store.list()
    unreachable = make_store({**s3_server.config(), "endpoint_url": "http://127.0.0.1:9"},
                             tmp_path / "m")
    with pytest.raises(RepositoryUnavailable, match="unreachable"):
        unreachable.list()
