"""The project speaks of itself only: no text in it refers to how its work was organised (work sessions, tracker
issues by number, section marks) — those words mean nothing to a user and go stale."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO

# "session" alone is fine (a pytest, Ray or MLflow session); numbered or possessive work sessions, numbered issues
# (upstream projects' issues are named with their repository, e.g. "Ray issue #57733") and section marks are not
FORBIDDEN = re.compile(
    r"\bsessions? \d+\b|\(session\b|\bthis session\b|\b(?<!Ray )(?<!torch )issue \d+\b|§|\bissue #?\d+ item\b",
    re.IGNORECASE,
)
TEXT = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", "Makefile", "Dockerfile", "run")


def test_no_words_about_how_the_work_was_organised() -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    hits = []
    for name in files:
        path = REPO / name
        if not name.endswith(TEXT) or not path.is_file() or name == "tests/test_project_words.py":
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if FORBIDDEN.search(line):
                hits.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_the_pattern_catches_what_it_should_and_spares_the_rest() -> None:
    for bad in (
        "measured in session 5",
        "(session 10, AMD EPYC)",
        "as issue 16 asked",
        "see § 3",
        "this session's box",
    ):
        assert FORBIDDEN.search(bad), bad
    for fine in ("once per pytest session", "a Ray session's logs", "Ray issue #57733", "session_dir", "sessions"):
        assert not FORBIDDEN.search(fine), fine
