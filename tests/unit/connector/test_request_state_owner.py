"""The scheduler role's per-request state has one owner: :class:`RequestState`.

Why: the scheduler and its step tracking both wrote its fields (blocks,
loads, saved chunks), each keeping rules the other had to know (a
preemption drops the planned load, a load's chunks are never saved
again). Now each event of a request's life is one named method of the
state, and the modules that hold states read fields only; the AST scan
below keeps it so, and the tests after it pin what each event changes.
"""

from __future__ import annotations

import ast
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

from kvstrata.connector.metadata import RequestTransfer
from kvstrata.connector.scheduler_state import RequestState
from kvstrata.sidecar import protocol as p

REPO = Path(__file__).resolve().parents[3]
OWNER = "connector/scheduler_state.py"
FIELDS = frozenset(RequestState.__dataclass_fields__)
# Methods that change a list or dict in place.
MUTATORS = frozenset({"append", "extend", "insert", "pop", "clear", "update", "remove", "sort"})


def _root(node: ast.AST) -> ast.AST:
    """The object an attribute or subscript chain starts from."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _chain(node: ast.AST) -> list[ast.AST]:
    """The links of an attribute or subscript chain, outermost first (not its
    subscripts' indices, nor a call's arguments)."""
    links = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        links.append(node)
        node = node.value
    return links


def state_writes(source: str) -> list[tuple[int, str]]:
    """``(line, field)`` of each write to a :class:`RequestState` field of a
    state the code holds (a chain not rooted at ``self``: a module's own
    attributes may share a field's name): assigned, augmented,
    subscript-assigned, or changed in place by a list or dict method."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                targets += target.elts if isinstance(target, ast.Tuple) else [target]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            targets = [node.func.value]
        for target in targets:
            root = _root(target)
            if isinstance(root, ast.Name) and root.id == "self":
                continue
            found += [
                (node.lineno, link.attr)
                for link in _chain(target)
                if isinstance(link, ast.Attribute) and link.attr in FIELDS
            ]
    return sorted(set(found))


def test_the_scan_finds_each_form_of_a_write() -> None:
    source = (
        "state.block_ids = []\n"
        "state.stored_chunks += 1\n"
        "state.load_tiers[tier] = 3\n"
        "state.block_ids[0].extend(ids)\n"
        "a, state.pending = 1, None\n"
        "n = state.stored_chunks\n"
        "self.load = None\n"
        "self.counters.hit_tokens += 1\n"
        "by_choice.setdefault(req.load_tiers, []).append(i)\n"
    )
    assert state_writes(source) == [
        (1, "block_ids"),
        (2, "stored_chunks"),
        (3, "load_tiers"),
        (4, "block_ids"),
        (5, "pending"),
    ]


def test_only_the_state_itself_writes_its_fields() -> None:
    modules = sorted((REPO / "connector").glob("*.py"))
    assert REPO / "connector" / "step_tracking.py" in modules
    bad = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in modules
        if path.relative_to(REPO).as_posix() != OWNER
        for line, name in state_writes(path.read_text())
    ]
    assert bad == [], f"change a RequestState through one of its methods: {bad}"


def _state() -> RequestState:
    return RequestState(SimpleNamespace(request_id="r"))  # type: ignore[arg-type]


def test_a_preemption_drops_the_blocks_and_the_load_planned_for_them() -> None:
    state = _state()
    state.scheduled([[1, 2]], 32)
    state.load_planned(RequestTransfer("r", []))
    state.preempted()
    assert (state.block_ids, state.load, state.num_computed) == ([], None, 32)


def test_blocks_scheduled_are_copied_and_grow_per_group() -> None:
    vllms = [[1, 2], [7]]
    state = _state()
    state.scheduled(vllms, 16)
    state.grew([[3], [8]], 48)
    state.grew(None, 64)  # no new blocks this step
    assert state.block_ids == [[1, 2, 3], [7, 8]]
    assert vllms == [[1, 2], [7]]  # vLLM's lists are not ours to extend
    assert state.num_computed == 64


def test_a_planned_load_goes_out_once() -> None:
    state = _state()
    load = RequestTransfer("r", [])
    state.load_planned(load)
    assert state.take_load() is load
    assert state.take_load() is None


def test_a_load_marks_its_chunks_known_never_fewer() -> None:
    state = _state()
    state.sent_for_saving(3)
    state.loading(2, {"l1": 32})
    assert (state.stored_chunks, state.load_tiers) == (3, {"l1": 32})
    state.loading(5, {"l2": 16})
    assert (state.stored_chunks, state.load_tiers) == (5, {"l2": 16})


def test_an_answer_pins_what_it_found_and_a_new_question_forgets_the_hit() -> None:
    state = _state()
    lookup: Future[p.LookupReply | None] = Future()
    state.lookup_started(lookup, 6)
    lookup.set_result(None)
    assert state.take_lookup_reply() is None
    assert state.pending is None
    state.answered(6, 2, ["l1", "l2"], 1, "l2")
    state.hit(40, load_async=True)
    assert (state.pinned, state.asked_blocks, state.hit_chunks, state.partial_tier) == (
        True,
        6,
        2,
        "l2",
    )
    state.answered(6, 2, ["l1", "l2"], 0, None)  # no partial named: the tier stays
    assert state.partial_tier == "l2"
    state.asked(SimpleNamespace(request_id="r"), 16)  # type: ignore[arg-type]
    assert (state.hit_tokens, state.load_async, state.local_tokens) == (0, False, 16)
    assert state.pinned  # the pins stay until the request ends
