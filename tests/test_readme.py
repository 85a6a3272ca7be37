"""Every ```python block of README.md runs as written.

A block's first line says how it runs:

* ``# file: NAME.py``: a module the other blocks import (the model, the step), as a real
  project would have it; written into the scratch directory before any block runs.
* ``# needs a GPU``: run only where CUDA is available (``test_gpu_blocks``, marked ``gpu``).
* anything else: a script, run by itself in a fresh Python process in the scratch directory,
  after the blocks before it in its ``##`` section (a later one may read what an earlier one
  wrote: the AOT artifact). The ``ple_ops`` runtime spawns a process that re-imports its
  script, which is why the blocks run as scripts and not in this process.

Every script prints what it did: a block that writes nothing to stdout fails, so a reader who
runs it sees that it worked, and so does one whose printed check reads ``: False`` or ``= False``.

A block that imports transformers or ``kv_ops.integrations.vllm``, where that is absent (the ``hf``
and ``vllm`` extras), ends its section's test as skipped, after the blocks before it ran.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
GPU = "# needs a GPU"
# What a block imports -> the module that must be installed for it to run (an extra of pyproject.toml).
EXTRAS = {r"^import .*\btransformers\b": "transformers", r"^import .*\bkv_ops\.integrations\.vllm\b": "vllm"}


def blocks(text: str) -> list[tuple[str, str]]:
    """(section heading, code) of every python block, in order; indented blocks (inside a list
    item) are dedented by their fence's indent."""
    found, section, code, indent, language = [], "", None, "", ""
    for line in text.splitlines():
        fence = FENCE.match(line)
        if code is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif fence:
                code, indent, language = [], fence.group(1), fence.group(2)
            continue
        if fence and fence.group(1) == indent and not fence.group(2):
            if language == "python":
                found.append((section, "\n".join(code) + "\n"))
            code = None
            continue
        code.append(line[len(indent) :] if line.startswith(indent) else line)
    return found


BLOCKS = blocks((ROOT / "README.md").read_text())
FILES = {code.split("\n", 1)[0].split(":", 1)[1].strip(): code for _, code in BLOCKS if code.startswith("# file:")}
SCRIPTS = [(section, code) for section, code in BLOCKS if not code.startswith("# file:")]
SECTIONS = list(dict.fromkeys(section for section, code in SCRIPTS if not code.startswith(GPU)))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    directory = tmp_path_factory.mktemp("readme")
    for name, code in FILES.items():
        (directory / name).write_text(code)
    return directory


def run(directory: Path, name: str, code: str) -> str:
    script = directory / name
    script.write_text(code)
    # This tree first: an installed offload-ops elsewhere must not answer the imports.
    path = [str(ROOT), str(directory), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=directory, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{result.stderr[-4000:]}"
    assert result.stdout.strip(), f"README block printed nothing (every block shows what it did):\n{code}"
    # The blocks print their checks as "what: True" or "what = True": False there is a failed check.
    assert not re.search(r"[:=] False\b", result.stdout), f"README block printed a failed check:\n{result.stdout}"
    return result.stdout


def test_the_readme_has_blocks_of_every_kind():
    assert len(SCRIPTS) >= 8 and FILES and any(code.startswith(GPU) for _, code in SCRIPTS)
    for name in FILES:  # a module no block imports would go untested
        module = name.removesuffix(".py")
        assert any(re.search(rf"^\s*(from|import) {module}\b", code, re.M) for _, code in SCRIPTS), name


def test_every_block_runs_from_an_installed_package():
    # A user runs the blocks after `pip install .`: none may import the checkout's examples/.
    assert [code for _, code in BLOCKS if re.search(r"^\s*(from|import) examples\b", code, re.M)] == []


def test_the_guide_and_the_design_notes_stay_short():
    # README is a user's guide and docs/design.md holds decisions; measurements live beside
    # their benchmarks (benchmarks/results/, docs/measurements.md).
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400
    assert len((ROOT / "docs" / "design.md").read_text().splitlines()) <= 350


@pytest.mark.parametrize("section", SECTIONS)
def test_section_blocks_run_as_written(scratch, section):
    codes = [code for s, code in SCRIPTS if s == section and not code.startswith(GPU)]
    for i, code in enumerate(codes):
        for pattern, module in EXTRAS.items():
            if re.search(pattern, code, re.M) and importlib.util.find_spec(module) is None:
                pytest.skip(f"block {i + 1} of {len(codes)} needs {module} (an extra); the blocks before it ran")
        run(scratch, f"block_{SECTIONS.index(section)}_{i}.py", code)


@pytest.mark.gpu
def test_gpu_blocks(scratch):
    for i, (_, code) in enumerate(c for c in SCRIPTS if c[1].startswith(GPU)):
        run(scratch, f"gpu_block_{i}.py", code)
