"""The repository speaks to its readers: no work-log vocabulary, no citations of documents a clone
does not have, no raw run outputs, and a BENCHMARKS.md that holds current figures only."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# numbered work-log references: session, sitting, call, run or issue (or their plurals) and a number
WORK_LOG = re.compile(r"\b(session|sitting|call|run|issue)s? #?[0-9]+(?!\.[0-9])", re.IGNORECASE)
# documents outside the repository: the project's private spec, the seed papers, sibling folders
OUTSIDE = re.compile(r"\bSPEC(\.md| ?§?[0-9])|\bseed 00[0-9]|\.\./shared")
RAW_OUTPUT = re.compile(r"(\.hlo(\.txt)?|\.sass|\.patch|\.ncu-rep|\.nsys-rep|\.xplane\.pb|command\.sh|bench_log.*)$")
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".txt", ".cfg", ".sh", ".json", ".csv", ""}


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / line for line in out.splitlines() if (REPO / line).is_file()]


def _text_files():
    for path in _tracked_files():
        if path.suffix in TEXT_SUFFIXES and path.stat().st_size < 2_000_000:
            try:
                yield path, path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue


def _hits(pattern: re.Pattern, skip=()) -> list[str]:
    found = []
    for path, text in _text_files():
        rel = path.relative_to(REPO).as_posix()
        if rel in skip:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{rel}:{lineno}: {line.strip()[:120]}")
    return found


def test_no_work_log_vocabulary():
    # this file names the patterns it guards against
    hits = _hits(WORK_LOG, skip={"tests/test_repository_hygiene.py"})
    assert not hits, "numbered work-log references (state the reason and its figure instead):\n" + "\n".join(hits[:40])


def test_no_citations_of_documents_outside_the_repository():
    hits = _hits(OUTSIDE, skip={"tests/test_repository_hygiene.py"})
    assert not hits, "cite the paper's equations and docs/design.md instead:\n" + "\n".join(hits[:40])


def test_no_raw_run_outputs_are_tracked():
    raw = [p.relative_to(REPO).as_posix() for p in _tracked_files() if RAW_OUTPUT.search(p.name)]
    assert not raw, f"raw outputs are not committed (commit the summary a doc shows): {raw[:20]}"
    big = [p.relative_to(REPO).as_posix() for p in _tracked_files()
           if p.stat().st_size > 1_000_000 and "data/bundled" not in p.as_posix()]  # the bundled corpus
    assert not big, f"files over 1 MB: {big}"


def test_benchmarks_holds_current_figures_only():
    lines = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, f"BENCHMARKS.md has {len(lines)} lines: one table per topic, a new figure replaces the old row"


def test_design_doc_keeps_the_section_numbers_code_cites():
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^## §(\d+)", text, flags=re.MULTILINE))
    cited = set()
    for path, body in _text_files():
        cited.update(re.findall(r"design\.md §(\d+)", body))
    assert cited, "no code cites docs/design.md"
    missing = sorted(cited - headings, key=int)
    assert not missing, f"docs/design.md has no section(s) {missing}, which the tree cites"
