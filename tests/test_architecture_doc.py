"""docs/architecture.md's table of layers says what pyproject.toml's layers contract
(which `lint-imports` enforces) says: the same packages, on the same rows, in the same
order; and every package and module of agentenv is on it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Test helpers and fakes may import anything and nothing imports them (the doc says so).
NOT_LAYERED = {"testing"}
# A row of the doc's table: | <layer> | `package`, `package` | what they own |
ROW = re.compile(r"^\| (\d+) \| ((?:`[a-z_]+`(?:, )?)+) \|")


def _doc_layers() -> list[set[str]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Packages, and the one-way rule", 1)[1].split("\n## ", 1)[0]
    rows: dict[int, set[str]] = {}
    for line in section.splitlines():
        m = ROW.match(line)
        if m:
            rows.setdefault(int(m[1]), set()).update(re.findall(r"`([a-z_]+)`", m[2]))
    assert sorted(rows) == list(range(1, len(rows) + 1)), "layers numbered 1, 2, ... in order"
    return [rows[n] for n in sorted(rows)]


def _contract_layers() -> list[set[str]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [{name.strip().removeprefix("agentenv.") for name in layer.split("|")}
            for layer in contract["layers"]]


def test_the_doc_lists_the_contract_s_layers() -> None:
    doc, contract = _doc_layers(), _contract_layers()
    assert len(doc) >= 10  # the table was found and read
    assert doc == contract


def test_every_package_and_module_is_on_a_layer() -> None:
    source = REPO / "src" / "agentenv"
    present = {p.stem for p in source.iterdir()
               if (p.is_dir() and (p / "__init__.py").is_file())
               or (p.suffix == ".py" and p.name != "__init__.py")}
    layered = set().union(*_contract_layers())
    assert present - NOT_LAYERED == layered
