"""The code's structure, checked on its source with ``ast`` (issue 29: every replay rule has
one owner, and no module reaches into another module's ``_private`` names).

A **reach-in** is an attribute access ``x._name`` (or ``from m import _name``) in one module
where ``_name`` is a private name some *other* project module defines and this module does
not: a class or module attribute, a method, a ``self._name = ...`` assignment, a module-level
function, class, assignment or import. ``self``/``cls``/``super()`` accesses are the owner's
own; a name this module also defines is treated as its own (``other._count`` in a class that
has ``_count`` is the same class's state); dunders are not private; names no project module
defines (numpy's, torch's, the standard library's: ``sys._getframe``, ``os._exit``) are not
the project's to police. ``python tests/test_structure.py`` prints the reach-ins.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("gearflow", "agents", "launch")  # the project's code (tests may poke at privates)

# (module, name): why the reach-in stays. Only where it cannot be avoided, or where the code
# is another area's and is listed here for its owner to fix.
ALLOWED: dict[tuple[str, str], str] = {
    ("gearflow.envs", "_recv"): "EnvPool's own API: its async recv without the gym wrapper's copy",
    ("gearflow.envs", "_send"): "EnvPool's own API: its async send of (env ids, actions) as arrays",
    ("gearflow.envs", "_spec"): "EnvPool's own API: the action spec of the env object",
    ("gearflow.tools.dryrun", "_base"): "torch's Tensor._base: the view's base, to count saved storage once",
    ("gearflow.bench.keys", "_gather"): "fault injection: wraps the table's gather so a writer laps the "
                                         "ring mid-copy (the benchmark of the stamp check, as test_replay_keys)",
    ("gearflow.bench.replay_stack", "_S_trust"): "measures the stacked-frame reach rule by switching it off",
}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            name = ".".join(rel.with_suffix("").parts)
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            try:
                out[name] = ast.parse(path.read_text(), str(rel))
            except FileNotFoundError:  # removed while the tree is walked
                continue
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _targets(node: ast.AST):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
        yield node.attr
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


def _defined(tree: ast.Module) -> set[str]:
    """The private names ``tree`` defines (at module level, in class bodies, on ``self``/``cls``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                names.update(_targets(t))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names.update(_targets(node.target))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _private(n)}


def _own(value: ast.AST) -> bool:
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("super", "type")


def _package(module: str) -> str:
    return module.rpartition(".")[0]


def reach_ins() -> list[tuple[str, int, str, str]]:
    """``(module, line, name, defined in)`` for every reach-in, sorted."""
    modules = _modules()
    defined = {m: _defined(t) for m, t in modules.items()}
    owners: dict[str, set[str]] = defaultdict(set)
    for m, names in defined.items():
        for n in names:
            owners[n].add(m)
    found = []
    for m, tree in modules.items():
        own = defined[m]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
                name = node.attr
                if name not in own and owners.get(name):
                    found.append((m, node.lineno, name, ",".join(sorted(owners[name]))))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                src = node.module
                for alias in node.names:
                    # a package's private submodule (replay/_hotpath) is its own package's to import
                    if _private(alias.name) and src in modules and src != m and src != _package(m):
                        found.append((m, node.lineno, alias.name, src))
    return sorted(found)


def test_no_module_reaches_into_another_modules_private_names():
    found = [r for r in reach_ins() if (r[0], r[2]) not in ALLOWED]
    listing = "\n".join(f"{m}:{line}: ._{name[1:]} (defined in {src})" for m, line, name, src in found)
    assert not found, f"{len(found)} reach-ins into other modules' private names:\n{listing}"


def test_the_allowlist_holds_only_reach_ins_that_exist():
    live = {(m, name) for m, _, name, _ in reach_ins()}
    assert not set(ALLOWED) - live, f"stale ALLOWED entries: {sorted(set(ALLOWED) - live)}"


if __name__ == "__main__":
    rows = reach_ins()
    for m, line, name, src in rows:
        tag = "  (allowed: " + ALLOWED[(m, name)] + ")" if (m, name) in ALLOWED else ""
        print(f"{m}:{line}: {name} (defined in {src}){tag}")
    print(f"{len(rows)} reach-ins, {sum((m, n) in ALLOWED for m, _, n, _ in rows)} allowed", file=sys.stderr)
