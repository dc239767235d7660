"""The repository reads as a product: no development diary, no paths outside the repository.

Every tracked text file under ``packages/``, ``docs/``, ``tests/`` and the root is searched for
the words and paths such text uses (work periods, borrowed machines, a history file, commit
hashes in prose, the development machine's folders). Benchmark reports under ``docs/results/``
are machine-written data and are left out.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".pyi", ".md", ".toml", ".sh", ".cpp", ".h", ".cu", ".cuh", ".txt", ".cfg"}
THIS = Path(__file__).resolve()

DIARY = re.compile(
    r"\bsessions?\b|\blease[sd]?\b|\bHISTORY\b|\bborrowed\b|\blent\b|work period"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\w+teenth"
    r"|twenty-\w+|twentieth)\b (?:session|period)"
    r"|\bissues? \d+\b|\.\./shared|\.device/|/root/|/work/",
    re.IGNORECASE,
)
# A commit hash in prose: 7-12 hex digits with at least one letter and one digit, standing alone.
COMMIT = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}(?![\w])")


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = []
    for name in listed:
        path = ROOT / name
        if name.startswith("docs/results/") or path.resolve() == THIS or not path.is_file():
            continue
        if path.suffix in SUFFIXES or path.name in {".gitignore", "run"}:
            files.append(path)
    return files


FILES = _tracked_text_files()


def test_there_are_files_to_check():
    assert any(p.name == "README.md" for p in FILES)
    assert any(p.suffix == ".cu" for p in FILES)


def test_a_diary_line_is_caught():
    assert DIARY.search("measured on one H200 lease in the ninth session")
    assert DIARY.search("see ../shared/spec")
    assert COMMIT.search("since commit f67c3fb the op reads back")
    assert not COMMIT.search("seed 0x9E3779B97F4A7C15 and 1234567 rows")


def test_no_history_and_no_outside_paths() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
        for path in FILES
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if DIARY.search(line) or COMMIT.search(line)
    ]
    assert not found, "\n".join(found)
