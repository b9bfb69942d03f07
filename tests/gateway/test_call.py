"""A request's record has one owner for each of its parts (gateway/call.py): the views write a Call's own fields;
choosing and sending write its Way, its answer its Used, each handed the record by name in its signature. Read
from the gateway's source, so a step that starts writing another's part fails here, not in a review."""

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
WRITERS = {"way": {"sending.py", "slots.py"}, "used": {"answers.py"}}  # each part's steps, as their parameter


def written(tree: ast.AST):
    """Every attribute the code assigns to (`x.y = `, `x.y += `, and inside tuples)."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store):
                    yield part


def trespasses(name: str, tree: ast.AST) -> list[str]:
    found = []
    for attr in written(tree):
        base, where = attr.value, f"{name}:{attr.lineno}"
        if isinstance(base, ast.Name) and base.id == "call" and name != "views.py":
            found.append(f"{where} writes call.{attr.attr} outside the views")
        if isinstance(base, ast.Attribute) and base.attr in WRITERS:
            found.append(f"{where} writes .{base.attr}.{attr.attr} through another record, not as its step")
        if isinstance(base, ast.Name) and base.id in WRITERS and name not in WRITERS[base.id]:
            found.append(f"{where} writes {base.id}.{attr.attr}, which only {sorted(WRITERS[base.id])} write")
    return found


def test_each_part_of_a_request_is_written_only_by_its_owner():
    found = []
    for path in sorted(GATEWAY.glob("*.py")):
        if path.name != "call.py":  # the records' own methods
            found += trespasses(path.name, ast.parse(path.read_text()))
    assert found == []


def test_the_check_sees_a_step_writing_what_is_not_its_own():
    sent = ast.parse("def send(gw, call, way):\n    call.model = 'x'\n    call.way.replica = 'r'\n    way.attempts += 1\n")
    assert trespasses("sending.py", sent) == [
        "sending.py:2 writes call.model outside the views",
        "sending.py:3 writes .way.replica through another record, not as its step",
    ]
    answered = ast.parse("def once(used, way):\n    used.prompt, way.lease = 1, None\n")
    assert trespasses("answers.py", answered) == [
        "answers.py:2 writes way.lease, which only ['sending.py', 'slots.py'] write"]
