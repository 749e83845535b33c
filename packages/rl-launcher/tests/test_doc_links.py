"""Every relative link in the docs and READMEs points at a file or folder that exists, so a
page such as docs/step_flow.md cannot keep linking to code that moved."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PATTERNS = ("*.md", "docs/*.md", "packages/*/README.md", "examples/*/README.md")
PAGES = sorted(page for pattern in PATTERNS for page in ROOT.glob(pattern))
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def broken_links(page: Path) -> list[str]:
    targets = (m.group(1) for m in LINK.finditer(page.read_text()))
    local = (t for t in targets if not re.match(r"[a-z]+:", t))  # http:, https:, mailto:
    return [t for t in local if not (page.parent / t).exists()]


def test_the_pages_are_found():
    assert ROOT / "docs" / "step_flow.md" in PAGES and len(PAGES) > 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_a_moved_file_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [web](https://x.org/a.md) [gone](../nowhere/loop.py#L3)")
    assert broken_links(page) == ["../nowhere/loop.py"]
