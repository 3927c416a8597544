"""The house rules that a reader can check mechanically: walls between rooms, no import cycles.

- No module reads or writes another module's underscore attributes (``x._name`` where ``x`` is
  not ``self``/``cls`` and ``_name`` is not defined in the module itself); a few private names of
  torch and CPython that have no public equivalent are listed with their reason.
- Views (``kit/widgets/``) never import the engine; the engine never imports the debug package
  (it knows a typed debug protocol) nor the session.
- No import cycle inside ``kit/`` (imports inside functions count too; ``if TYPE_CHECKING:`` blocks,
  which never run, do not).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parents[1] / "kit"
PRIVATE = re.compile(r"^_(?!_)(?!repr_)(?!ipython_)")  # IPython's _repr_*_ / _ipython_*_ are protocols
THIRD_PARTY = {  # name: why kit reaches it — none for speed; each has no public equivalent
    "_C": "torch._C._current_autograd_node: the replay names the forward line that made a NaN in the backward "
          "(debugging only; looked up with getattr, absent in some torch versions)",
    "_new_shared": "torch.UntypedStorage._new_shared: shared-memory batches from data workers",
    "_iterator": "DataLoader._iterator: shutting its workers down without a new iterator",
    "_shutdown_workers": "the DataLoader iterator's worker shutdown",
    "_exit": "os._exit (public, documented): a worker process whose kernel is gone ends itself from its "
             "watcher thread, without a signal and without running the kernel's exit handlers",
}
PRIVATE_MODULES = {  # modules named with an underscore that kit imports, and why
    "torch.utils._python_dispatch": "TorchDispatchMode, the replay's per-op check (its only home in torch)",
}


def modules() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(KIT.rglob("*.py"))}


def _owned(tree: ast.Module) -> set[str]:
    """Private names a module defines: its functions/classes, its own attributes (``self._x``), its globals."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.AnnAssign,)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if PRIVATE.match(n)}


def reaches(trees: dict[Path, ast.Module]) -> list[str]:
    found = []
    for path, tree in trees.items():
        owned = _owned(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and PRIVATE.match(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in owned or node.attr in THIRD_PARTY:
                continue
            found.append(f"{path.relative_to(KIT.parent)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_modules_underscore_attributes():
    assert reaches(modules()) == []


def test_the_check_finds_a_reach_through():
    """Negative control: a module that reads another module's private attribute is reported."""
    tree = ast.parse("def peek(session):\n    return session._stashed_state\n")
    assert reaches({KIT / "widgets" / "peek.py": tree}) == ["kit/widgets/peek.py:2 session._stashed_state"]


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def imports(path: Path, tree: ast.Module) -> set[str]:
    """The kit modules ``path`` imports when it runs, anywhere in it."""
    out = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kit")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kit"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # from kit.engine import state
    return out


def module_name(path: Path) -> str:
    parts = list(path.relative_to(KIT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, set[str]]:
    trees = modules()
    names = {module_name(p) for p in trees}
    edges = {}
    for path, tree in trees.items():
        me = module_name(path)
        # a package's __init__ re-exporting its own modules is not an edge back to the package
        edges[me] = {m for m in imports(path, tree) if m in names and m != me and not m.startswith(me + ".")}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycle_inside_kit():
    edges = graph()
    # "kit" itself resolves names lazily (kit.Session, ...): every module may import kit.errors etc.
    edges = {m: {t for t in ts if t != "kit"} for m, ts in edges.items() if m != "kit"}
    assert [c for c in cycles(edges) if c not in KNOWN_CYCLES] == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize(("room", "never"), [
    ("kit.widgets", "kit.engine"),
    ("kit.engine", "kit.debug"),
    ("kit.engine", "kit.session"),
    ("kit.engine", "kit.widgets"),
    ("kit.session", "kit.widgets.dashboard"),
])
def test_rooms_do_not_import_what_they_must_not_know(room, never):
    edges = graph()
    bad = {m: sorted(t for t in ts if t == never or t.startswith(never + "."))
           for m, ts in edges.items() if m == room or m.startswith(room + ".")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_views_never_touch_the_engine_of_a_session():
    """kit/widgets/ reads a Session through its public API and events only."""
    found = [f"{p.relative_to(KIT.parent)}:{n.lineno}" for p, tree in modules().items() if "widgets" in p.parts
             for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "engine"]
    assert found == []


def test_no_ctypes_and_no_private_module_beyond_the_listed_ones():
    """Public ground: kit reads no memory by address, and imports private modules only where listed."""
    found = []
    for path, tree in modules().items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "ctypes" or (parts[0] in ("torch", "numpy", "_signal", "_random")
                                            and any(p.startswith("_") for p in parts)
                                            and not any(name.startswith(m) for m in PRIVATE_MODULES)):
                    found.append(f"{path.relative_to(KIT.parent)}:{node.lineno} {name}")
    assert found == []


def _progress_writes(trees: dict[Path, ast.Module]) -> list[str]:
    fields = {"epoch", "step_in_epoch", "global_train_step", "num_updates", "accum_count", "epoch_running",
              "steps_exhausted", "consec_skipped_updates", "skipped_updates_in_epoch", "epoch_start_global_step",
              "last_complete_frac"}
    found = []
    for path, tree in trees.items():
        if path.name == "progress.py":
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and t.attr in fields and isinstance(t.value, (ast.Name, ast.Attribute)):
                        owner = ast.unparse(t.value)
                        if owner in ("p", "progress") or owner.endswith("progress"):
                            found.append(f"{path.relative_to(KIT.parent)}:{node.lineno} {ast.unparse(t)}")
    return found


def test_progress_fields_are_written_only_by_its_transitions():
    assert _progress_writes(modules()) == []


def test_the_progress_check_finds_a_write():
    tree = ast.parse("def f(engine):\n    p = engine.progress\n    p.accum_count = 0\n")
    assert _progress_writes({KIT / "engine" / "x.py": tree}) == ["kit/engine/x.py:3 p.accum_count"]


def _whole_engine_parameters(trees: dict[Path, ast.Module]) -> list[str]:
    """Functions outside ``kit/engine/`` with a parameter annotated ``Engine``: each collaborator is given
    what it uses (a narrow Protocol or the parts), never the whole engine."""
    found = []
    for path, tree in trees.items():
        if path.parent.name == "engine":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    if arg.annotation is not None and re.search(r"\bEngine\b", ast.unparse(arg.annotation)):
                        found.append(f"{path.relative_to(KIT.parent)}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_no_function_outside_the_engine_takes_the_whole_engine():
    assert _whole_engine_parameters(modules()) == []


def test_the_whole_engine_check_finds_one():
    tree = ast.parse("def lr_find(engine: Engine, n: int) -> None:\n    pass\n")
    assert _whole_engine_parameters({KIT / "x.py": tree}) == ["kit/x.py:1 lr_find(engine)"]
