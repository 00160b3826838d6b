"""Check that every relative link in README.md resolves: the file exists in the
repository and, when the link names an anchor, the target page has that heading.

`make lint` runs it beside `mkdocs build --strict`, which checks the links between
the pages of docs/ (the README is not one of them). Exit status 1 lists the bad links.
"""
from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def heading_slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*]", "", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors_of(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    anchors: set[str] = set()
    for heading in HEADING.findall(text):
        slug = heading_slug(heading)
        unique, n = slug, 0
        while unique in anchors:  # repeated headings get _1, _2, ... as in MkDocs
            n += 1
            unique = f"{slug}_{n}"
        anchors.add(unique)
    return anchors


def broken_links(readme: Path) -> list[str]:
    text = FENCE.sub("", readme.read_text(encoding="utf-8"))
    problems = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        page = (readme.parent / path_part).resolve() if path_part else readme
        if not page.exists():
            problems.append(f"{target}: no such file")
        elif anchor and anchor not in anchors_of(page):
            problems.append(f"{target}: no heading #{anchor} in {path_part}")
    return problems


def main() -> int:
    problems = broken_links(ROOT / "README.md")
    for problem in problems:
        print(f"README.md: broken link {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
