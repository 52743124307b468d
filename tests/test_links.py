"""The evidence's links resolve: every relative link in README.md, docs/*.md and the READMEs under results/ and lab/
names a file or folder that exists, and every #anchor on a link names a heading of the markdown file it points to
(GitHub's slugs: lowercase, spaces to '-', punctuation other than '-' and '_' dropped, a repeated heading gets -1,
-2, ...). A path written alone in a code span (`results/x.txt`, `../lab/y.py`) must exist too: that is how the
docs cite a file without linking it.

Pure text, no torch: runs in well under a second."""

import re
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

def markdown_files():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("results", "lab"):
        files += sorted((ROOT / folder).rglob("README.md"))
    return [f for f in files if f.is_file()]


FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# A code span that is a path into the evidence and nothing else (no spaces, no glob or placeholder).
CITED_PATH = re.compile(r"^(?:\.\./)*(?:results|lab|docs)/[\w./-]*$")


def prose_lines(path):
    """(line number, text) of the lines outside fenced code blocks."""
    inside = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def links(path):
    """(line number, target) of every markdown link and reference definition, code spans left out."""
    for number, line in prose_lines(path):
        text = CODE_SPAN.sub("", line)
        for match in INLINE_LINK.finditer(text):
            yield number, match.group(1)
        match = REFERENCE_DEF.match(text)
        if match:
            yield number, match.group(1)


def cited_paths(path):
    """(line number, path) of every code span that is a path under results/, lab/ or docs/."""
    for number, line in prose_lines(path):
        for match in CODE_SPAN.finditer(line):
            span = match.group(2).strip()
            if CITED_PATH.match(span):
                yield number, span


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = unicodedata.normalize("NFC", text).strip().lower()
    text = "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


def anchors(path):
    """Every anchor GitHub makes for the headings of a markdown file."""
    seen = {}
    result = set()
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def is_external(target):
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def problems_of(path):
    """What is wrong with the links of one markdown file, one line each."""
    problems = []
    where = path.relative_to(ROOT)
    for number, target in links(path):
        if is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if file_part and not resolved.exists():
            problems.append(f"{where}:{number}: {target}: no such file")
            continue
        if anchor:
            if resolved.is_dir() or resolved.suffix != ".md":
                problems.append(f"{where}:{number}: {target}: an anchor on a file that is not markdown")
            elif anchor not in anchors(resolved):
                problems.append(f"{where}:{number}: {target}: no heading with that anchor in {resolved.name}")
    for number, cited in cited_paths(path):
        candidates = [(path.parent / cited).resolve(), (ROOT / cited).resolve()]
        if not any(c.exists() for c in candidates):
            problems.append(f"{where}:{number}: `{cited}`: no such file")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(path):
    problems = problems_of(path)
    assert not problems, "\n".join(problems)


def test_slugs_follow_githubs_rules():
    assert slug("The classifier (issue 47)") == "the-classifier-issue-47"
    assert slug("CUDA graphs and the host") == "cuda-graphs-and-the-host"
    assert slug("What did not work, and why") == "what-did-not-work-and-why"
    assert slug("`fp8_reach=\"blocks\"`: the attention's projections") == "fp8_reachblocks-the-attentions-projections"
    assert slug("Where the step's time goes") == "where-the-steps-time-goes"
    assert slug("Going further") == "going-further"


def test_a_broken_link_or_anchor_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "kept.txt").write_text("x")
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Two words\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[fine](results/kept.txt) [fine](docs/a.md#two-words) [fine](#here) [ext](https://example.com/x)\n"
        "[fine too](results/kept.txt) `results/kept.txt`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "# Here\n"
        "[gone](results/gone.txt) [bad anchor](docs/a.md#three-words) `results/missing.txt` [self](#nowhere)\n")
    found = problems_of(page)
    assert len(found) == 4, found
    assert all(":7:" in p for p in found), found  # the fence lines count
