"""The product speaks only of itself: no tracked file narrates who ran what, when, or at which commit.

Every file git tracks (and every untracked one it does not ignore) is read, except images, the
benchmarks' CSV results and this file. A line fails when it has:

* *session*, *lease* or *lent* as a word of prose (an identifier such as ``start_new_session`` or a
  quoted ``"session"``, pytest's fixture scope, is code, not prose);
* an ordinal from *fourth* on tied to a run ("the tenth session", "the fourteenth session's run",
  "the sixteenth's 0.985", "the 12th run");
* an ISO date (``2026-12-01``);
* a commit in prose: 7 to 40 hex digits in backticks, or after *at*, *since*, *until*, *commit*
  and the like; a hex word counts only if it has both a digit and a letter, so that ```1024``` and
  ```deadbeef``` pass.

History belongs to git; README and the docs say what is true now.
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_SUFFIXES = {".png", ".csv", ".jpg", ".jpeg", ".gif", ".whl", ".so", ".pt", ".bin"}

WORD = re.compile(r"(?<![\w\"'])(sessions?|leases?|leased|lent)(?![\w\"'])", re.I)
_ORDINALS = (
    "fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth fourteenth fifteenth sixteenth "
    "seventeenth eighteenth nineteenth twentieth"
).split()
ORDINAL = re.compile(
    r"\b(?:(?:twenty|thirty)-?)?(?:" + "|".join(_ORDINALS) + r"|\d+(?:st|nd|rd|th))"
    r"(?:'s\b|\s+(?:session|run|lease|lent|machine)s?\b)",
    re.I,
)
DATE = re.compile(r"(?<![\w.-])(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?![\w-])")
_HEX = r"[0-9a-f]{7,40}"
COMMIT = re.compile(
    rf"`({_HEX})`|\b(?:at|since|until|before|after|commit|from|on|of)\s+({_HEX})\b(?![\w.-])",
    re.I,
)


def _is_commitish(text: str) -> bool:
    return bool(re.search(r"\d", text)) and bool(re.search(r"[a-f]", text, re.I))


def findings(line: str) -> list[str]:
    """What ``line`` says of past runs: each matched piece, as it stands in the line."""
    found = [m.group(0) for m in WORD.finditer(line)]
    found += [m.group(0) for m in ORDINAL.finditer(line)]
    found += [m.group(0) for m in DATE.finditer(line)]
    found += [m.group(0) for m in COMMIT.finditer(line) if _is_commitish(m.group(1) or m.group(2))]
    return found


def tracked_files() -> list[Path]:
    listed = []
    for args in (["ls-files"], ["ls-files", "--others", "--exclude-standard"]):
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        listed += out.splitlines()
    this = Path(__file__).resolve()
    paths = (ROOT / name for name in dict.fromkeys(listed))
    return [p for p in paths if p.is_file() and p.suffix.lower() not in SKIP_SUFFIXES and p.resolve() != this]


@pytest.mark.parametrize(
    "line",
    [
        "The fifteenth session's four runs gave 1.027",
        "the sixteenth's 0.985",
        "on the lent GPU machine",
        "two leases whose host ran slower",
        "measured 2026-12-01 on the H200",
        "the last sanitizer runs (`2ca9b60`)",
        "the run at 8d5d75e had the staged default",
        "the 12th run",
    ],
)
def test_each_kind_of_narration_is_found(line):
    assert findings(line), line


@pytest.mark.parametrize(
    "line",
    [
        "proc = subprocess.Popen(cmd, start_new_session=True)",
        '@pytest.fixture(scope="session")',
        "the first run of a size compiles; a second run reuses it",
        "release the flags, then lease_count += 1",
        "ids = `1024` blocks of `deadbeef` poison",
        "torch>=2.11 and vllm==0.32.0, CUDA 13.0-13.3",
        "the fourth argument is the layer",
        "excellent, talented, silent",
    ],
)
def test_code_and_plain_prose_pass(line):
    assert not findings(line), findings(line)


def test_no_tracked_file_narrates_past_runs():
    bad = []
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for number, line in enumerate(text.splitlines(), 1):
            for piece in findings(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {piece!r}")
    assert not bad, f"{len(bad)} narrations of past runs (history belongs to git):\n" + "\n".join(bad)
