"""The house rules on the tree's shape, checked in the source of kv_ops/ and ple_ops/: no file over
500 lines, no function over 60 code lines, no reach into another object's private names outside
the one shim module per dependency, and no comment citing a measurement taken on a named GPU.

Each check is a helper run once per file (a failure names the file, and the function or line), and
each helper is shown to catch what it exists to catch on a synthetic source first.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for package in ("kv_ops", "ple_ops") for p in (ROOT / package).rglob("*.py"))
MAX_FILE_LINES = 500  # every line counted
MAX_FUNCTION_LINES = 60  # code lines: the docstring, blank and comment-only lines not counted
# The dependency shims: the one module per dependency that may read that dependency's private
# names, each saying why and which release of the dependency would break it. Triton's shim,
# kv_ops/cuda/launch.py, reads only public attributes of Triton's compiled kernel: no entry here.
SHIMS = {
    "kv_ops/cuda/torch_internals.py",  # torch's (with CPython's sys._getframe, to find Inductor's frame)
    "ple_ops/runtime/multiprocessing_internals.py",  # multiprocessing's
}
# torch._check and torch._check_value are torch's documented way for a fake to state a condition.
ALLOWED_PRIVATE = ("_check",)


def file_lines(source: str) -> int:
    """The lines of a file, every one counted."""
    return len(source.splitlines())


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (nested ones too, each on its own) with more than ``limit`` code lines:
    lines of its ``def`` to its end, less its docstring, blank lines and comment-only lines."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = set()
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            doc = set(range(first.lineno, first.end_lineno + 1))
        code = sum(
            1
            for i in range(node.lineno, node.end_lineno + 1)
            if i not in doc and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#")
        )
        if code > limit:
            found.append(f"{node.name} (line {node.lineno}): {code} code lines")
    return found


def private_reaches(source: str) -> list[str]:
    """Every ``x._name`` (one leading underscore or a mangled ``__name``, not a dunder) read or
    written on an object other than ``self`` and ``cls``, ``torch._check*`` excepted."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Name) and owner.id == "torch" and node.attr.startswith(ALLOWED_PRIVATE):
            continue
        if isinstance(owner, ast.Name) and owner.id == "os" and node.attr == "_exit":
            continue  # os's documented exit without clean-up: the underscore is historical, not private
        found.append(f"line {node.lineno}: {ast.unparse(owner)}.{node.attr}")
    return found


# A comment says why the code is so; a figure measured on some GPU goes beside its benchmark
# (docs/measurements.md, the results' files), where the next run replaces it.
GPU_NAMES = re.compile(r"\b(?:[AHBL]\d{2,3}|GH200|GB200|RTX \d{4})\b")


def cited_figures(source: str) -> list[str]:
    """Every comment (``#``, not a docstring) that names a GPU, as a measurement's source does."""
    comments = (t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT)
    return [f"line {t.start[0]}: {t.string.strip()}" for t in comments if GPU_NAMES.search(t.string)]


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --- the helpers catch what they exist to catch ----------------------------------------------------


def test_file_lines_counts_every_line_blank_and_comment_ones_too():
    source = "x = 1\n\n# a comment\n" * 167  # 501 lines
    assert file_lines(source) == 501 > MAX_FILE_LINES
    assert file_lines("x = 1\n" * MAX_FILE_LINES) == MAX_FILE_LINES


def test_long_functions_counts_code_lines_only():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    padding = '    """A docstring\n\n    over lines."""\n\n    # a comment\n\n'
    fits = f"def fits():\n{padding}{body}"  # def line + 59 statements: 60
    assert long_functions(fits) == []
    over = f"async def over():\n{padding}{body}    y = 0\n"
    assert long_functions(over) == [f"over (line 1): {MAX_FUNCTION_LINES + 1} code lines"]


def test_long_functions_names_a_long_method_and_a_long_nested_function():
    body = "".join(f"            x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f"class A:\n    def method(self):\n        def inner():\n{body}        return inner\n"
    assert long_functions(source) == [
        f"method (line 2): {MAX_FUNCTION_LINES + 3} code lines",
        f"inner (line 3): {MAX_FUNCTION_LINES + 1} code lines",
    ]


def test_private_reaches_names_each_reach_and_lets_self_cls_dunders_and_torch_check_be():
    source = textwrap.dedent(
        """
        import torch
        def f(other, module):
            self._a, cls._b = other.__dict__, other.__class__
            torch._check(True)
            torch._check_value(True)
            os._exit(1)
            other._private = 1
            y = module.inner._hooks
            return torch._C._cuda_getDevice() + other.__mangled
        """
    )
    assert private_reaches(source) == [
        "line 8: other._private",
        "line 9: module.inner._hooks",
        "line 10: other.__mangled",
        "line 10: torch._C._cuda_getDevice",
        "line 10: torch._C",
    ]


def test_cited_figures_names_each_comment_naming_a_gpu_and_lets_docstrings_and_code_be():
    source = textwrap.dedent(
        '''
        def f():
            """Measured on the H200."""  # docstrings may: they are the reference
            name = "H100"  # a string in code is no comment
            x = 1  # 2.4 ms less on the H200
            # the A100's rate
            return x  # every 10 ms (a code fact, no GPU named)
        '''
    )
    assert cited_figures(source) == ["line 5: # 2.4 ms less on the H200", "line 6: # the A100's rate"]


def test_the_shims_exist_and_say_why():
    for shim in SHIMS:
        source = (ROOT / shim).read_text()
        assert private_reaches(source), f"{shim} is listed as a shim but reads no private name"
        assert "# Why:" in source and "Breaks if" in source, f"{shim} does not say why, or what breaks it"


# --- the tree -------------------------------------------------------------------------------------


def test_the_tree_has_sources():
    assert len(SOURCES) > 20 and all(p.suffix == ".py" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=_relative)
def test_no_file_is_over_500_lines(path):
    n = file_lines(path.read_text())
    assert n <= MAX_FILE_LINES, f"{_relative(path)} has {n} lines (at most {MAX_FILE_LINES})"


@pytest.mark.parametrize("path", SOURCES, ids=_relative)
def test_no_function_is_over_60_code_lines(path):
    found = long_functions(path.read_text())
    assert found == [], f"{_relative(path)}: {'; '.join(found)} (at most {MAX_FUNCTION_LINES})"


@pytest.mark.parametrize("path", SOURCES, ids=_relative)
def test_no_comment_cites_a_figure_measured_on_a_named_gpu(path):
    found = cited_figures(path.read_text())
    assert found == [], f"{_relative(path)}: {'; '.join(found)} (figures go beside their benchmark)"


@pytest.mark.parametrize("path", [p for p in SOURCES if _relative(p) not in SHIMS], ids=_relative)
def test_no_private_name_is_read_off_another_object_outside_the_shims(path):
    found = private_reaches(path.read_text())
    assert found == [], f"{_relative(path)} reaches into private names: {'; '.join(found)}"
