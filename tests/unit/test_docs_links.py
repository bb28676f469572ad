"""Every relative link in the documentation points at something that exists.

Checked pages: README.md, docs/*.md, the markdown files under benchmarks/ and
model_repository/. For each inline link or image ``[text](target)`` and each reference
definition ``[label]: target`` outside code (fenced blocks and inline code spans):

- a target with a scheme (``https:``, ``mailto:``) is external and not checked;
- an absolute path (``/...``) is an error: links are relative to the page;
- the file or directory must exist, inside the repository;
- ``#anchor`` on a markdown page (or alone, for the page itself) must be the GitHub slug
  of one of that page's headings (or an HTML ``id``/``name``); on other files only
  GitHub's line anchors (``#L10``, ``#L10-L20``) are accepted.

Slugs follow GitHub (github-slugger): the heading's text without markdown, lower case,
every character that is not a letter, mark, digit, connector (``_``), space or ``-``
removed, each space replaced by ``-``; a repeated slug gets ``-1``, ``-2``, ...

Plain stdlib: no project imports, no servers.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
HTML_ID = re.compile(r"""<[a-zA-Z][^>]*\s(?:id|name)\s*=\s*["']([^"']+)["']""")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target "title") / ![alt](target); text may hold one level of brackets and
# may wrap lines.
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>\n]*>|[^\s()]+(?:\([^\s()]*\)[^\s()]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>\n]*>|\S+)", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
LINE_ANCHOR = re.compile(r"^L\d+(?:-L\d+)?$")


def doc_pages(root: Path = REPO) -> list[Path]:
    """Return the markdown pages whose links are checked."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for folder in ("benchmarks", "model_repository"):
        pages += sorted((root / folder).rglob("*.md"))
    return [p for p in pages if p.is_file()]


def _strip_code(text: str) -> list[str]:
    """Return the page's lines with fenced code blocks blanked (line structure kept)."""
    out: list[str] = []
    fence: str | None = None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def github_slug(heading: str) -> str:
    """Return the anchor GitHub gives a heading with this text (before de-duplication)."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "")
    text = text.strip().lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in " -" or cat[0] in "LMN" or cat == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Return every anchor a markdown page defines: heading slugs and HTML ids."""
    lines = _strip_code(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    seen: dict[str, int] = {}

    def add(heading: str) -> None:
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")

    prev = ""
    for line in lines:
        m = ATX.match(line)
        if m:
            add(m.group(2) or "")
            prev = ""
            continue
        paragraph = prev.strip() and not prev.lstrip().startswith(("|", "-", "*", ">"))
        if SETEXT.match(line) and paragraph:
            add(prev.strip())
            prev = ""
            continue
        for ident in HTML_ID.findall(line):
            found.add(ident)
        prev = line
    return found


def links(path: Path) -> list[str]:
    """Return the link targets of a page, outside code blocks and code spans."""
    lines = _strip_code(path.read_text(encoding="utf-8"))
    text = CODE_SPAN.sub("", "\n".join(lines))
    targets = [m.group(1) for m in INLINE_LINK.finditer(text)]
    targets += REF_DEF.findall(text)
    return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in targets]


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Return one message per link of `page` that points at nothing."""
    problems = []
    for target in links(page):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # external
        where = f"{page.relative_to(root)}: ({target})"
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if path_part.startswith("/"):
            problems.append(f"{where}: absolute path; link relative to the page")
            continue
        dest = (page.parent / path_part).resolve() if path_part else page
        if root.resolve() not in (dest, *dest.parents):
            problems.append(f"{where}: points outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file {dest.relative_to(root.resolve())}")
            continue
        if not anchor:
            continue
        anchor = unquote(anchor)
        if dest.suffix.lower() == ".md" and dest.is_file():
            if anchor not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
        elif not LINE_ANCHOR.match(anchor):
            problems.append(f"{where}: anchor #{anchor} on a file that is not markdown")
    return problems


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_an_existing_file_and_heading(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checked_pages_include_the_readme_the_docs_and_the_results():
    names = {str(p.relative_to(REPO)) for p in doc_pages()}
    assert {"README.md", "docs/operations.md", "benchmarks/RESULTS.md"} <= names


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Quick start: two commands", "quick-start-two-commands"),
        ("The `hps` backend (embedding lookup)", "the-hps-backend-embedding-lookup"),
        ("config.pbtxt", "configpbtxt"),
        ("Caches: one per (model, device, table)", "caches-one-per-model-device-table"),
        (
            "Table load: per-instance index (`benchmarks/bench_table_load.py`) (issue 3)",
            "table-load-per-instance-index-benchmarksbench_table_loadpy-issue-3",
        ),
        (
            "Served overhead: a Python floor with the same I/O (issue 10)",
            "served-overhead-a-python-floor-with-the-same-io-issue-10",
        ),
        ("Q1. NumSample", "q1-numsample"),
        ("Size - and  spaces", "size---and--spaces"),
        ("See [the notes](notes.md)", "see-the-notes"),
    ],
)
def test_slugs_follow_github(heading, slug):
    assert github_slug(heading) == slug


def test_the_checker_reports_a_missing_file_a_missing_anchor_and_an_absolute_path(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Page A\n\n## Same\n\n## Same\n\nSetext heading\n---\n", encoding="utf-8"
    )
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "Good: [a](docs/a.md), [a's heading](docs/a.md#same-1),\n"
        "[setext](docs/a.md#setext-heading),\n"
        "[here](#top), [web](https://example.com/x#y), `[code](missing.md)`.\n\n"
        "```\n[in a fence](missing.md)\n```\n\n"
        "Bad: [gone](docs/b.md), [no such\nheading](docs/a.md#nowhere), [abs](/etc/passwd),\n"
        "[self](#bottom), [out](../outside.md).\n\n"
        "[ref]: docs/c.md\n",
        encoding="utf-8",
    )
    problems = broken_links(readme, root=tmp_path)
    assert [p.split(": (")[1].split(")")[0] for p in problems] == [
        "docs/b.md",
        "docs/a.md#nowhere",
        "/etc/passwd",
        "#bottom",
        "../outside.md",
        "docs/c.md",
    ]
