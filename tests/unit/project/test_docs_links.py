"""Every link of README.md, BENCHMARKS.md and docs/ points at a file of the repository (and, with
`#anchor`, at one of its headings); none points outside it."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#+ (.*)", page.read_text(), re.M)}


def broken_links(pages: list[Path], repo: Path) -> list[str]:
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            where = f"{page.relative_to(repo)}: ({target})"
            if re.match(r"\w+:", target):
                broken.append(f"{where} leaves the repository")
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or repo not in dest.parents:
                broken.append(f"{where} names no file of the repository")
            elif anchor and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading '#{anchor}' in {dest.relative_to(repo)}")
    return broken


def test_every_link_resolves():
    broken = broken_links(PAGES, REPO)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_planted_broken_links_are_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](#no-such-heading) [b](missing.md) [c](https://x.org) [d](#title)\n")
    broken = broken_links([page], tmp_path)
    assert len(broken) == 3, broken
    assert "no-such-heading" in broken[0] and "missing.md" in broken[1] and "leaves" in broken[2]
