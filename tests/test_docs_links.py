"""Every relative link in README.md and docs/**/*.md resolves: the file exists, and a #anchor names a heading of
the target page by its GitHub slug. External links (http, https, mailto) are not fetched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the text may hold inline code or brackets one level deep.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, with their numbers."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page offers: its headings' slugs (repeats numbered as GitHub numbers them) and HTML anchors."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of each link; a reference definition counts only where a paragraph may begin."""
    out, previous = [], ""
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        bare = INLINE_CODE.sub("", line)
        out.extend((number, target) for target in LINK.findall(bare))
        ref = REFERENCE.match(bare)
        if ref and not previous.strip():
            out.append((number, ref.group(1)))
        previous = line
    return out


def broken(page: Path) -> list[str]:
    problems = []
    for number, target in links(page):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = page if not path_part else (page.parent / path_part).resolve()
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where} (no such file)")
            continue
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where} (outside the repository)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} (no heading with that anchor in {dest.relative_to(ROOT)})")
    return problems


def test_the_pages_are_found():
    assert ROOT / "README.md" in PAGES and len(PAGES) > 3


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    assert broken(page) == []


def test_slugs_follow_github():
    assert slug("Disaggregated prefill and decode") == "disaggregated-prefill-and-decode"
    assert slug("The `tandem serve` stack (local)") == "the-tandem-serve-stack-local"
    assert slug("P/D and KV transfer: NIXL, TCP") == "pd-and-kv-transfer-nixl-tcp"
    assert slug("Engine on CPU — SmolLM2") == "engine-on-cpu--smollm2"


def test_a_broken_link_is_found(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    page = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Here\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    page.write_text("[ok](b.md#here) [ok](b.md#twice-1) [x](b.md#there) [y](c.md) `[z](d.md)`\n"
                    "```\n[w](e.md)\n```\n[ext](https://example.com/none)\nprose\n[1, 4]: not a link\n\n[r]: f.md\n", encoding="utf-8")
    assert [p.split(": ", 1)[1] for p in broken(page)] == [
        "b.md#there (no heading with that anchor in b.md)", "c.md (no such file)", "f.md (no such file)"]
