"""No test asserts a wall-clock bound: a loaded machine breaks such a bound with no bug to find.

A heuristic, file by file under tests/ and compile_tests/: a value is *timed* when it comes from
``time.perf_counter``, ``time.time`` or ``time.monotonic`` (or their ``_ns`` forms), directly or
through names assigned from one; an ``assert`` with a comparison that sets a timed value against a
non-zero number written out is a wall-clock bound. Compare with a reference taken in the same run
instead (a bare copy timed beside it, the window timed around a call), or print it as a benchmark.
Not flagged: a comparison with a name (the deadline a polling loop gives up at, so that a hang
fails instead of hanging), a sign check against 0. Not seen: a time that reaches the assert
through a container or an attribute.

No file has one: a bound a test needs is an object's own timeout or a module's documented constant
(read by name), or a time taken beside it in the same run.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMERS = {"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns"}


def _is_timer(node: ast.AST, bare: set[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr in TIMERS and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in bare


def _timed(node: ast.AST, names: set[str], bare: set[str]) -> bool:
    return any(_is_timer(n, bare) or (isinstance(n, ast.Name) and n.id in names) for n in ast.walk(node))


def _number(node: ast.AST) -> bool:
    """A non-zero number written out: ``0.05``, ``-1``, ``50e-3``, ``1 / 20``."""
    allowed = (ast.Constant, ast.UnaryOp, ast.BinOp, ast.operator, ast.unaryop)
    if not all(isinstance(n, allowed) for n in ast.walk(node)):
        return False
    if any(isinstance(n, ast.Constant) and type(n.value) not in (int, float) for n in ast.walk(node)):
        return False
    try:
        return eval(compile(ast.Expression(node), "<number>", "eval"), {"__builtins__": {}}) != 0
    except ArithmeticError:
        return False


def timed_bounds(source: str) -> list[tuple[int, str]]:
    """``(line, condition)`` of each assert in ``source`` that bounds a timed value by a number."""
    tree = ast.parse(source)
    bare = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "time"
        for alias in node.names
        if alias.name in TIMERS
    }
    names: set[str] = set()
    grown = True
    while grown:  # names assigned from timed values, until no more are found
        grown = False
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                if not _timed(node.value, names, bare):
                    continue
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name) and n.id not in names:
                            names.add(n.id)
                            grown = True
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in ast.walk(node.test):
            if isinstance(compare, ast.Compare):
                operands = [compare.left, *compare.comparators]
                if any(_timed(o, names, bare) for o in operands) and any(_number(o) for o in operands):
                    found.append((node.lineno, ast.unparse(node.test)))
                    break
    return found


def bounds_under(root: Path) -> list[str]:
    """``path:line: assert condition`` of each wall-clock bound in the test files under ``root``."""
    files = sorted(p for folder in ("tests", "compile_tests") for p in (root / folder).rglob("*.py"))
    return [
        f"{path.relative_to(root).as_posix()}:{line}: assert {condition}"
        for path in files
        for line, condition in timed_bounds(path.read_text())
    ]


def test_no_test_asserts_a_wall_clock_bound():
    assert any((ROOT / "tests").rglob("test_*.py"))  # the walk sees the test files
    found = bounds_under(ROOT)
    assert not found, "wall-clock bounds (compare with a same-run reference instead):\n" + "\n".join(found)


def test_the_walk_finds_a_bound_in_a_test_file_of_either_folder(tmp_path):
    clean = "import time\nstart = time.perf_counter()\nassert time.perf_counter() - start < rt.step_timeout\n"
    for folder in ("tests/ple_ops", "compile_tests"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "test_clean.py").write_text(clean)
    assert bounds_under(tmp_path) == []
    (tmp_path / "compile_tests" / "test_late.py").write_text(clean.replace("rt.step_timeout", "1.0"))
    assert bounds_under(tmp_path) == ["compile_tests/test_late.py:3: assert time.perf_counter() - start < 1.0"]


OLD = """
t0 = time.perf_counter()
worker.submit_store(7, spec, chunks)
(result,) = worker.get_finished()
elapsed = time.perf_counter() - t0
assert result.job_id == 7 and 0 < result.transfer_time < 0.05 <= elapsed
"""

NEW = """
t0 = time.perf_counter()
worker.submit_store(7, spec, chunks)
submit = time.perf_counter() - t0
(result,) = worker.get_finished()
assert result.job_id == 7 and 0 < result.transfer_time <= submit
"""


@pytest.mark.parametrize(
    "source,flagged",
    [
        (OLD, True),  # transfer_time under a fixed 50 ms, which a loaded machine breaks
        (NEW, False),  # transfer_time within the submit call timed around it
        ("from time import monotonic as now\nstart = now()\nassert now() - start < 1e-1", True),
        ("import time\ndeadline = time.monotonic() + 5\nassert time.monotonic() < deadline", False),
        ("import time\nt = time.time()\nassert t > 0", False),
        # The forms the tests use instead: the object's timeout by name, a time taken beside it.
        ("import time\nstart = time.monotonic()\nassert 0.9 < time.monotonic() - start < 1.5", True),
        (
            "import time\nstart = time.monotonic()\nassert rt.step_timeout < time.monotonic() - start < 2 * rt.step_timeout",
            False,
        ),
        ("import time\ns = time.perf_counter()\ntook = time.perf_counter() - s\nassert took < AT_ONCE * sleep", False),
        ("import time\ns = time.perf_counter()\nx = (time.perf_counter() - s) * 1e3\nassert x < 50", True),
        ("n = 3\nassert n < 5", False),
    ],
)
def test_the_heuristic(source, flagged):
    assert bool(timed_bounds(source)) is flagged
