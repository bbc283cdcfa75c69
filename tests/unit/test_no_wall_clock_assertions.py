"""The suite asserts no wall-clock time: an AST scan of every test module.

Why: an assertion on how long something took (``assert elapsed < 0.5``) or
on which of two racing things finished first by the clock passes on a quiet
machine and fails on a loaded one. Tests order what they check by steps,
events and counters; speed targets live in ``bench/``.

What counts as a wall-clock assertion here: an ``assert`` (or an ``if`` that
fails the test) whose condition compares something taken from the clock,
i.e. a call of ``time.time``/``monotonic``/``perf_counter`` (and their
``_ns`` forms), a name assigned from an expression holding one (``t0``,
``elapsed``), a list such a value is appended to, or a name that says it is
a duration (``elapsed``, ``took``, ``latency``...). Reading the clock to
bound a wait (``while time.monotonic() < deadline: poll()``) or to pass a
time to the code under test is not a comparison in an assertion and is fine.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# Files allowed to assert on the clock, each with the reason. Benchmarks
# belong in bench/, so this stays empty.
ALLOWED: dict[str, str] = {}

CLOCK_FUNCTIONS = frozenset(
    {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"}
)
DURATION_NAME = re.compile(
    r"(^|_)(elapsed|took|duration|durations|latency|latencies|slowest|fastest|"
    r"wall|ttft|first_token_s|finished_s|gaps?)($|_)",
    re.IGNORECASE,
)


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):  # time.monotonic()
        return (
            func.attr in CLOCK_FUNCTIONS
            and isinstance(func.value, ast.Name)
            and func.value.id == "time"
        )
    # from time import monotonic; monotonic()
    return isinstance(func, ast.Name) and func.id in CLOCK_FUNCTIONS - {"time"}


def _names_in(node: ast.AST) -> set[str]:
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
    return found


def _timed_names(tree: ast.AST) -> set[str]:
    """Names (module-wide, conservatively) that hold clock readings or durations."""
    timed: set[str] = set()
    changed = True
    while changed:  # to a fixed point: t0 = monotonic(); elapsed = monotonic() - t0; ...
        changed = False
        for node in ast.walk(tree):
            targets: list[ast.AST] = []
            value: ast.AST | None = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                targets, value = [node.target], node.value
            elif (  # xs.append(<timed>)
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"append", "extend", "add"}
                and node.args
            ):
                targets, value = [node.func.value], node.args[0]
            if value is None or not _holds_time(value, timed):
                continue
            for target in targets:
                for name in _target_names(target):
                    if name not in timed:
                        timed.add(name)
                        changed = True
    return timed


def _target_names(target: ast.AST) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Attribute):
        return {target.attr}
    if isinstance(target, ast.Subscript):
        return _target_names(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        # got, took = timed(...): only the names that say they are durations
        return {n for e in target.elts for n in _target_names(e) if DURATION_NAME.search(n)}
    return set()


# Calls whose result is still the time or duration they were given.
PASS_THROUGH = frozenset(
    {"max", "min", "sum", "sorted", "abs", "round", "float", "int", "median", "mean", "fsum"}
)


def _walk_values(node: ast.AST):
    """ast.walk, but not into the arguments of a call to the code under test:
    ``expire_leases(now=t0 + 2)`` or ``query_range(expr, start, end)`` hands
    a time to the code (an injected clock), and what it returns is not a
    measurement. ``max(latencies)`` and the like pass a duration through."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        if isinstance(n, ast.Call) and not _is_clock_call(n):
            func = n.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            todo.append(func)
            if name in PASS_THROUGH:
                todo.extend(n.args)
            continue
        todo.extend(ast.iter_child_nodes(n))


def _holds_time(node: ast.AST, timed: set[str]) -> bool:
    for n in _walk_values(node):
        if _is_clock_call(n):
            return True
        if isinstance(n, ast.Name) and n.id in timed:
            return True
    return False


def _compares_time(node: ast.AST, timed: set[str]) -> bool:
    for n in ast.walk(node):
        if not isinstance(n, ast.Compare):
            continue
        for operand in [n.left, *n.comparators]:
            if _holds_time(operand, timed):
                return True
            # A fresh clock reading inside an assertion, even one handed to
            # the code (``expire(now=time.monotonic() + 0.5) == 0``), is
            # measured against whatever happened before: as racy as elapsed.
            if any(_is_clock_call(m) for m in ast.walk(operand)):
                return True
            if any(DURATION_NAME.search(name) for name in _names_in(operand)):
                return True
    return False


def _fails_the_test(body: list[ast.stmt]) -> bool:
    for stmt in body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Raise):
                return True
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "fail"
            ):
                return True
    return False


def _is_wait_guard(node: ast.Assert) -> bool:
    """``assert time.monotonic() < deadline`` as the give-up check of a polling loop."""
    test = node.test
    return (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], (ast.Lt, ast.LtE))
        and _is_clock_call(test.left)
        and isinstance(test.comparators[0], ast.Name)
    )


def _asserts_outside_wait_loops(tree: ast.AST) -> list[ast.Assert]:
    found: list[ast.Assert] = []

    def visit(node: ast.AST, in_loop: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, (ast.While, ast.For)):
                visit(child, True)
            else:
                if isinstance(child, ast.Assert) and not (in_loop and _is_wait_guard(child)):
                    found.append(child)
                visit(child, in_loop)

    visit(tree, False)
    return found


def wall_clock_assertions(source: str, filename: str = "<test>") -> list[int]:
    """Line numbers of the assertions in ``source`` that compare clock readings."""
    tree = ast.parse(source, filename)
    timed = _timed_names(tree)
    lines = [n.lineno for n in _asserts_outside_wait_loops(tree) if _compares_time(n.test, timed)]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and _fails_the_test(node.body)
            and _compares_time(node.test, timed)
        ):
            lines.append(node.lineno)
    return sorted(set(lines))


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)


def test_no_test_asserts_on_the_wall_clock():
    offenders = []
    for path in _test_modules():
        relative = path.relative_to(TESTS).as_posix()
        if relative in ALLOWED:
            continue
        for line in wall_clock_assertions(path.read_text(), relative):
            offenders.append(f"tests/{relative}:{line}")
    assert offenders == [], (
        "wall-clock assertions (order by steps, events or counters; speed goes to bench/):\n  "
        + "\n  ".join(offenders)
    )


def test_every_allowed_file_exists_and_says_why():
    for relative, reason in ALLOWED.items():
        assert (TESTS / relative).is_file(), relative
        assert reason.strip(), relative


@pytest.mark.parametrize(
    "source",
    [
        "import time\nt0 = time.monotonic()\nf()\nassert time.monotonic() - t0 < 5\n",
        "import time\nt0 = time.time()\nf()\nelapsed = time.time() - t0\nassert elapsed < 1\n",
        "from time import perf_counter\ns = perf_counter()\nassert perf_counter() - s < 2\n",
        "import time\nxs = []\nfor _ in r:\n    t = time.monotonic()\n    f()\n"
        "    xs.append(time.monotonic() - t)\nassert max(xs) < 0.5\n",
        "got, took = timed(f)\nassert got is None and took < 0.7\n",
        "assert run.finished_s['a'] < run.first_token_s['b']\n",
        "import time\nassert engine.expire_leases(now=time.monotonic() + 0.5) == 0\n",
        "import time\nwhile busy():\n    t0 = time.monotonic()\n    step()\n"
        "    assert time.monotonic() - t0 < 0.2\n",
        "import time\nt0 = time.monotonic()\nif time.monotonic() - t0 > 3:\n"
        "    pytest.fail('slow')\n",
    ],
    ids=[
        "inline",
        "elapsed-var",
        "from-import",
        "list",
        "tuple-target",
        "named",
        "fresh-reading-handed-over",
        "in-loop",
        "if-fail",
    ],
)
def test_the_scan_finds_clock_assertions(source: str):
    assert wall_clock_assertions(source) != []


@pytest.mark.parametrize(
    "source",
    [
        # a bounded wait is not an assertion
        "import time\ndeadline = time.monotonic() + 5\n"
        "while time.monotonic() < deadline:\n    poll()\nassert done()\n",
        # the give-up check of a polling loop
        "import time\ndeadline = time.monotonic() + 20\nwhile not done():\n"
        "    assert time.monotonic() < deadline, 'never done'\n    poll()\n",
        # a time handed to the code under test, then a counter compared
        "import time\nassert engine.expire_leases(now=clock.now) == 0\n",
        "import time\nt0 = time.monotonic()\nassert engine.expire_leases(now=t0 + 1.5) == 2\n",
        # a configured deadline read back is a value, not a measurement
        "assert client.call_timeout_s == 2\nassert stats.errors_total['timeout'] >= 1\n",
        "import time\nstamp = time.time()\nassert record['ts'] is not None\n",
        # data fetched for a time range is data, not a duration
        "import time\nstart = time.time()\nseries = prom.query_range(q, start, end)\n"
        "assert max(values(series)) <= 1.0\n",
    ],
    ids=[
        "bounded-wait",
        "wait-guard",
        "injected-clock",
        "injected-reading",
        "config-read-back",
        "unrelated-assert",
        "time-range-data",
    ],
)
def test_the_scan_leaves_legitimate_code_alone(source: str):
    assert wall_clock_assertions(source) == []
