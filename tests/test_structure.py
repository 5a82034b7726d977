"""The code's structure, checked on its source with ``ast`` (issue 29: every replay rule has
one owner, and no module reaches into another module's ``_private`` names; issue 48: imports run
one way among the top layers, and an actor is built in one place).

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


# ---------------------------------------------------------------------- import direction (issue 48)
#
# The top layers, from the top: entry points (they choose a plan and run it) → the topology (the
# plan, the one builder, the lifecycle, the runs of a plan) → the roles it builds → the parts
# (actors, learner, replay, transport, params, run, ...). An import may only go down. Every import
# counts, the lazy ones inside functions included, and so does importlib.import_module("...").

ENTRY_POINTS = ("gearflow.cli", "gearflow.runner", "gearflow.__main__", "gearflow.launchers",
                "gearflow.bench")  # ``gearflow bench``: a benchmark runs whole runs, as gearflow train does
TOPOLOGY, ROLES = ("gearflow.topology",), ("gearflow.roles",)
# the plan is a leaf of data (the modes, launchers and roles by name; it imports only errors): the
# config's checks read the names there, as they read the kind and transport registries
LEAVES = ("gearflow.topology.plan",)
LAYERS = {  # layer: (its modules, what they must not import, why)
    "topology": (TOPOLOGY, ENTRY_POINTS, "the topology imports no entry point (cli, runner, launchers)"),
    "roles": (ROLES, TOPOLOGY + ENTRY_POINTS, "a role imports neither the topology that builds it nor an entry point"),
    "parts": (("gearflow", "agents"), ROLES + TOPOLOGY + ENTRY_POINTS,
              "a part imports no role, no topology and no entry point"),
}


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _layer(module: str) -> str | None:
    if _in(module, ENTRY_POINTS):
        return None
    for name in ("topology", "roles", "parts"):
        if _in(module, LAYERS[name][0]):
            return name
    return None


def imported(module: str, tree: ast.Module, is_package: bool) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``tree`` — at module level or inside a function,
    relative ones resolved, ``importlib.import_module("literal")`` included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            out += [(node.lineno, mod)] + [(node.lineno, f"{mod}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            out.append((node.lineno, node.args[0].value))
    return out


def upward_imports(root: Path = ROOT) -> list[str]:
    """``module:line imports target (rule)`` for every import against :data:`LAYERS` under ``root``."""
    found = []
    for top in ("gearflow", "agents"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            parts = list(rel.with_suffix("").parts)
            package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if package else parts)
            layer = _layer(module)
            if layer is None:
                continue
            _, banned, why = LAYERS[layer]
            for line, target in imported(module, ast.parse(path.read_text(), str(rel)), package):
                if _in(target, banned) and not _in(target, LEAVES):
                    found.append(f"{module}:{line} imports {target} ({why})")
    return sorted(set(found))


def test_imports_run_one_way_among_the_top_layers():
    found = upward_imports()
    assert not found, f"{len(found)} imports against the layers:\n" + "\n".join(found)


def test_the_plan_is_a_leaf():
    tree = ast.parse((ROOT / "gearflow" / "topology" / "plan.py").read_text())
    ours = {t for _, t in imported("gearflow.topology.plan", tree, False) if _in(t, ("gearflow",))}
    assert ours <= {"gearflow.errors", "gearflow.errors.ConfigError", "gearflow.errors.GearflowError"}, ours


def test_an_actor_is_built_in_one_place():
    """Only the actor-process factory (``actors/process.py``: ``make_actor``, under ``build_actor``)
    instantiates the agent's kind's actor class; every actor process (local, remote, evaluation)
    and the serial actor go through it."""
    calls = []
    for m, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "actor_class_for":
                calls.append(f"{m}:{node.lineno}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Call)
                  and isinstance(node.func.func, ast.Name) and node.func.func.id == "actor_class_for"):
                calls.append(f"{m}:{node.lineno}")
    benchmarks = {"gearflow.transport.bench"}  # the actor class itself over three writers, measured
    assert {c.split(":")[0] for c in calls} - benchmarks == {"gearflow.actors.process"}, calls


def test_every_request_name_is_a_typed_constant():
    """A request name (``replay.sample``, ``run.join``, ...) is written once, as a constant of
    ``transport/ops.py`` (:class:`~gearflow.transport.ops.Rpc`); code that registers or calls one uses
    the constant (docstrings may show the name)."""
    from gearflow.transport import ops

    names = set(ops.RPCS)
    found = []
    for m, tree in _modules().items():
        if m in ("gearflow.transport.ops", "gearflow.config"):  # config keys share the form: run.progress is one
            continue
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs:
                found.append(f"{m}:{node.lineno}: {node.value!r}")
    assert not found, "bare request names (use gearflow.transport.ops' constants):\n" + "\n".join(found)
    assert len(names) == len(ops.RPCS) and all(isinstance(n, ops.Rpc) for n in names)


if __name__ == "__main__":
    rows = reach_ins()
    for m, line, name, src in rows:
        tag = "  (allowed: " + ALLOWED[(m, name)] + ")" if (m, name) in ALLOWED else ""
        print(f"{m}:{line}: {name} (defined in {src}){tag}")
    print(f"{len(rows)} reach-ins, {sum((m, n) in ALLOWED for m, _, n, _ in rows)} allowed", file=sys.stderr)
