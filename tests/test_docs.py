"""The README and ``docs/`` pages: every relative link points to a file that exists, and every
``#anchor`` to a heading of that page (GitHub's slugs), so moving text between pages cannot
leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_slugs_follow_github() -> None:
    assert slug("Crash-safe publish (file tiers)") == "crash-safe-publish-file-tiers"
    assert slug("`n > 1` and slot statuses") == "n--1-and-slot-statuses"
    assert slug("The server's request path") == "the-servers-request-path"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    dead = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not dead, "\n".join(dead)


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    for command in ("make serve", "make test"):
        assert command in readme
    linked = {Path(t.partition("#")[0]).name for t in links(ROOT / "README.md")}
    for page in ("server", "configuration", "cache", "cluster", "operations", "architecture"):
        assert f"{page}.md" in linked, page
