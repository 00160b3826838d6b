"""The one filesystem walk both sides of a filesystem-only pause use (envd/fs_walk.py):
envd's listing of a tree and the node's walk of the same tree agree entry by entry."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from agentenv.envd.fs_walk import walk
from agentenv.orchestrator.disk_pause import changed_paths


def _tree(root: Path) -> None:
    (root / "etc").mkdir()
    (root / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    (root / "proc").mkdir()
    (root / "proc" / "1").write_text("not the sandbox's")
    (root / "bin").mkdir()
    (root / "bin" / "sh").symlink_to("/bin/busybox")
    os.mkfifo(root / "pipe")
    with socket.socket(socket.AF_UNIX) as s:  # a socket is not listed
        s.bind(str(root / "sock"))


def test_paths_are_seen_from_inside_the_root_and_kinds_are_the_table_s(tmp_path: Path) -> None:
    _tree(tmp_path)
    listed = dict(walk(str(tmp_path), frozenset({"/proc"})))
    assert sorted(listed) == ["/bin", "/bin/sh", "/etc", "/etc/hosts", "/pipe"]
    assert listed["/etc/hosts"][0] == "f" and listed["/etc/hosts"][4] == 20
    assert listed["/etc"][0] == "d" and listed["/etc"][4] == 0  # sizes of files only
    assert listed["/bin/sh"][0] == "l" and listed["/bin/sh"][6] == "/bin/busybox"
    assert listed["/pipe"][0] == "p"
    # A trailing slash names the same root.
    assert dict(walk(str(tmp_path) + "/", frozenset({"/proc"}))) == listed


def test_a_listing_of_a_tree_compared_with_a_walk_of_it_differs_where_it_changed(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _tree(root)
    lower = dict(walk(str(root)))
    listing = tmp_path / "listing.jsonl"

    def listed_as_envd_sends_it() -> None:
        listing.write_text("".join(json.dumps([path, *entry]) + "\n"
                                   for path, entry in walk(str(root))))

    listed_as_envd_sends_it()
    assert changed_paths(listing, lower, tmp_path / "keep.jsonl") == []
    (root / "etc" / "hosts").write_text("changed\n")
    (root / "etc" / "new").write_text("")
    listed_as_envd_sends_it()
    assert sorted(changed_paths(listing, lower, tmp_path / "keep.jsonl")) == \
        ["/etc/hosts", "/etc/new"]
