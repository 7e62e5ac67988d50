"""The structure issue 11 asks for, held by tests rather than comments: the package's import graph has
no cycle, no backend imports a sibling backend, and no module imports another's private names."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastdata"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> list[tuple[str, list[str]]]:
    """(imported fastdata module, names taken from it) for every import in the file, nested ones too."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            if target in modules:
                found.append((target, names))
            found += [(f"{target}.{n}", []) for n in names if f"{target}.{n}" in modules]
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name in modules]
    return [(t, n) for t, n in found if t != name]


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_import_graph_has_no_cycle():
    # The package's __init__ re-exports everything; an edge back to it is not a design dependency.
    edges = {m: {t: f"{m} -> {t}" for t, _ in deps if t != "fastdata"} for m, deps in _graph().items()}
    cycle = _find_cycle(edges)
    assert cycle is None, "import cycle:\n" + "\n".join(cycle)


def _room(module: str) -> str:
    """The room a module is in, as a reader sees the package: a folder is one room
    (``fastdata.shards.cache`` → ``shards``), a top-level module is a room of its own
    (``fastdata.cli`` → ``cli``), and the package's ``__init__`` is the front door (``""``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _room_edges(graph) -> dict[str, dict[str, str]]:
    """{room: {room it imports: one import that shows it ("module -> module")}}. An import of the front
    door is left out, as in the module graph (it re-exports everything)."""
    edges: dict[str, dict[str, str]] = {}
    for m, deps in graph.items():
        for t, _ in deps:
            if t != "fastdata" and _room(t) != _room(m):
                edges.setdefault(_room(m), {}).setdefault(_room(t), f"{m} -> {t}")
    return edges


def _find_cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle in a graph of {node: {node it imports: the import that shows it}} (modules, or rooms),
    each step with its import, or None."""
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for target in sorted(edges.get(node, {})):
            if state.get(target) == 1:
                loop = path[path.index(target):] + [target]
                return [f"{a} -> {b} ({edges[a][b]})" for a, b in zip(loop, loop[1:])]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_import_cycle_among_rooms():
    """Issue 32: a folder is one room and a top-level module is one; no room imports one that imports
    it back, through any path (pack inside ``shards`` made cli → registry → datasets → shards → cli)."""
    cycle = _find_cycle(_room_edges(_graph()))
    assert cycle is None, "import cycle among rooms:\n" + "\n".join(cycle)


def test_the_room_cycle_check_finds_a_cycle_through_folders():
    # Modules inside folders, no cycle among the modules themselves, one among their rooms.
    graph = {"fastdata.a.x": [("fastdata.b.y", [])], "fastdata.b.y": [("fastdata.c", [])],
             "fastdata.c": [("fastdata.a.z", [])], "fastdata.a.z": [], "fastdata": [("fastdata.a.x", [])]}
    assert _room("fastdata.a.x") == "a" and _room("fastdata.c") == "c" and _room("fastdata") == ""
    cycle = _find_cycle(_room_edges(graph))
    assert cycle is not None and cycle[0].startswith("a -> b (fastdata.a.x -> fastdata.b.y)")
    del graph["fastdata.c"][0]
    assert _find_cycle(_room_edges(graph)) is None


def test_a_folder_is_on_one_floor():
    """A FLOORS entry names a room (a folder or a top-level module), never a module inside a folder:
    splitting a folder across floors would hide an import cycle among rooms."""
    inside = [name for names in FLOORS for name in names if "." in name]
    assert not inside, f"FLOORS entries inside a folder: {inside}"


def _backend(module: str) -> str | None:
    """The backend a module belongs to: ``fastdata.backends.memory.cache`` → ``memory`` (a backend may be a
    package of modules); None for a module outside backends/ or for the shared ones."""
    parts = module.split(".")
    if parts[:2] != ["fastdata", "backends"] or len(parts) < 3 or parts[2] == "base":
        return None
    return parts[2]


def test_no_backend_imports_a_sibling_backend():
    for m, deps in _graph().items():
        if _backend(m):
            siblings = {t for t, _ in deps if _backend(t) not in (None, _backend(m))}
            assert not siblings, f"{m} imports {sorted(siblings)}: share code through a module outside backends/"


def test_a_backends_own_modules_are_not_its_siblings():
    assert _backend("fastdata.backends.memory.cache") == _backend("fastdata.backends.memory") == "memory"
    assert _backend("fastdata.backends.dali") == "dali" and _backend("fastdata.backends.base") is None
    assert _backend("fastdata.backends") is None and _backend("fastdata.decode") is None


def test_no_module_imports_another_modules_private_names():
    for m, deps in _graph().items():
        private = [f"{t}.{n}" for t, names in deps for n in names if n.startswith("_") and n != "__version__"]
        assert not private, f"{m} imports private names {private}"


def test_every_public_name_has_a_docstring():
    """Issue 12: 'docstrings on every public name'. Functions and classes a module defines (not ones it
    imports), and their public methods and properties, unless a base class documents the method."""
    import importlib
    import inspect
    import pkgutil

    import fastdata

    missing = []
    for info in pkgutil.walk_packages(fastdata.__path__, "fastdata."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if not (obj.__doc__ or "").strip():
                missing.append(f"{module.__name__}.{name}")
            if not inspect.isclass(obj):
                continue
            for attr, value in vars(obj).items():
                func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if attr.startswith("_") or not inspect.isfunction(func) or (func.__doc__ or "").strip():
                    continue
                if not any((getattr(getattr(base, attr, None), "__doc__", None) or "").strip()
                           for base in obj.__mro__[1:]):
                    missing.append(f"{module.__name__}.{name}.{attr}")
    assert not missing, f"public names without a docstring: {missing}"


# ------------------------------------------------------------------------------------------- floors
#: The package's floors, lowest first (issue 24): a module may import its own floor and the ones below,
#: never one above, nested imports included. Derived from the import graph; a module is placed by its
#: longest matching name. A folder is one room and sits on one floor: an entry never names a module
#: inside a folder (``test_a_folder_is_on_one_floor``). A new module must be placed here.
FLOORS = [
    # Foundations: errors, seeds and order, the normalizer, the shard format and storage.
    # ``checks``: the integer/range/choice checks every room shares. ``host_memory``: the RAM a process
    # may use (the memory backend's budget, dali's prefetch depth). ``pathlock``: one process at a time on
    # a path (a run's checkpoint, its log folder).
    ("checks", "errors", "sampling", "normalize", "prefetch", "models", "shards", "host_memory", "pathlock"),
    # Tensor-only augmentation of device batches: needs only sampling's seed mixing. Below config because
    # LoaderConfig checks its batch_transforms when it is built (a real dependency, not an accident).
    ("batch_transforms",),
    ("config",),
    # The recipe's parameters and their application on arrays, and process groups, each built on the
    # config alone.
    ("augment", "distributed"),
    # Every decoder, one image file's bytes → pixels (a box, a whole photo, the on_error policy): below
    # datasets, whose sources decode a photo themselves (ImageFolder.__getitem__, to_rgb).
    ("images",),
    ("datasets",),
    ("decode",),
    ("backends",),
    ("registry",),
    # The training loop and what records it; it never names a backend, the registry or a report.
    ("engine", "checkpoint", "profiling", "runlog"),
    ("cli", "doctor"),
    # The examples' reporting tail: above the engine (it asks it which precision amp resolved to).
    ("report",),
    # Commands and the package's front door: pack (``packing``) reads any source and the CLI's checks.
    # ``transforms`` and ``region``: the old import paths of augment, images.photo and images.region,
    # re-exports that nothing in the package imports.
    ("bench", "packing", "__main__", "", "transforms", "region"),
]


def _floor(module: str) -> int:
    name = module.removeprefix("fastdata").removeprefix(".")
    best = None
    for level, names in enumerate(FLOORS):
        for prefix in names:
            if name == prefix or (prefix and name.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[1]):
                    best = (level, prefix)
    assert best is not None, f"{module} is on no floor: place it in tests/test_architecture.py's FLOORS"
    return best[0]


def test_a_lower_floor_never_imports_a_higher_one():
    modules = _modules()
    wrong = []
    for m, deps in _graph().items():
        for target, names in deps:
            # "from . import distributed" names the submodule (also listed as an edge), not the package's
            # __init__; any other name taken from the package itself is an import of the top floor.
            if target == "fastdata" and all(f"fastdata.{n}" in modules for n in names):
                continue
            if _floor(target) > _floor(m):
                wrong.append(f"{m} (floor {_floor(m)}) imports {target} (floor {_floor(target)})")
    assert not wrong, "imports up the floors:\n" + "\n".join(sorted(set(wrong)))


def test_the_floors_place_the_modules_where_the_tests_rely_on():
    # The floor test can only fail if _floor tells the floors apart: the longest prefix wins.
    assert _floor("fastdata.shards.index") == 0 < _floor("fastdata.batch_transforms.ops") < _floor("fastdata.config")
    assert _floor("fastdata.packing.writer") == _floor("fastdata") == len(FLOORS) - 1
    assert _floor("fastdata.shards") == _floor("fastdata.shards.cache") == 0
    assert _floor("fastdata.backends.memory.cache") == _floor("fastdata.backends")


# ----------------------------------------------------------------------------- private attributes
#: Private attributes of other libraries that fastdata reads on purpose, each with its reason. A fastdata
#: module never reads another fastdata module's private attribute: that one gets a public name instead.
THIRD_PARTY_PRIVATE = {
    "_add_dataloader": "accelerate's GradientState: a loader not prepared by accelerate registers itself so "
                       "that end_of_dataloader and remainder work (backends/base.py)",
    "_remove_dataloader": "accelerate's GradientState: the pair of _add_dataloader",
    "_iterator": "torch's DataLoader: its live iterator, to shut persistent workers down on close()",
    "_shutdown_workers": "torch's DataLoader iterator: stops the workers now, not at garbage collection",
    "_workers": "torch's DataLoader iterator: its worker processes, to name a dead one (pid, signal)",
    "_getframe": "sys: the user's stack level for warnings, without inspect.stack()'s cost",
    "_foreach_lerp_": "torch: the EMA update as one fused kernel, no host sync",
    "_BatchNorm": "torch.nn: the base class of every BatchNorm layer",
    "_C": "torch: _storage_Use_Count, the only way to know a pooled buffer is free",
    "_storage_Use_Count": "torch._C: see _C",
    "_current_graph_task_id": "torch._C: -1 outside backward; tells a checkpoint's recomputation (which "
                              "torch.utils.checkpoint keys by it) from a real forward (models.py)",
    "_cdata": "torch's UntypedStorage: the handle _storage_Use_Count takes",
    "_parent": "fsspec: the parent folder of a path under the file system's own rules (protocols, buckets)",
    "_orig_mod": "torch.compile's OptimizedModule: the module it wraps, whose weights a checkpoint keeps "
                 "(torch has no public accessor for it)",
    "_get_default_store": "torch.distributed: the default group's key-value store, where failing ranks leave "
                          "their error lines without a collective (cli.exit_with); torch has no public accessor",
}


def _private_reads(tree) -> list[tuple[int, str, str]]:
    """(line, attribute, expression) for each read of ``x._name`` or ``getattr(x, "_name")`` (hasattr
    too) where ``x`` is not ``self``, ``cls`` or ``super()``; dunders are not private."""
    def private(attr):
        return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))

    def owner_is_self(v):
        return (isinstance(v, ast.Name) and v.id in ("self", "cls")) or (
            isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and private(node.attr) \
                and not owner_is_self(node.value):
            found.append((node.lineno, node.attr, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and private(node.args[1].value) \
                and not owner_is_self(node.args[0]):
            found.append((node.lineno, node.args[1].value, ast.unparse(node)))
    return found


def _defined(tree) -> set[str]:
    """Names a module defines: functions, classes, assigned names and attributes (``x._a = ...``,
    ``setattr(x, "_a", ...)``, ``object.__setattr__(x, "_a", ...)``), class fields."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
                    elif isinstance(sub, ast.Name):
                        names.add(sub.id)
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and ast.unparse(node.func) in ("setattr", "object.__setattr__"):
            names.add(node.args[1].value)
    return names


def _cross_module_private_reads():
    """([(module, attribute, message)] read across fastdata modules, [message] of other libraries' reads
    missing from THIRD_PARTY_PRIVATE)."""
    trees = {m: ast.parse(p.read_text()) for m, p in _modules().items()}
    defined = {m: _defined(t) for m, t in trees.items()}
    wrong, unlisted = [], []
    for m, tree in trees.items():
        for line, attr, text in _private_reads(tree):
            if attr in defined[m]:
                continue
            owners = sorted(o for o, names in defined.items() if attr in names)
            if owners:
                wrong.append((m, attr, f"{m}:{line} reads {text}, which {', '.join(owners)} defines"))
            elif attr not in THIRD_PARTY_PRIVATE:
                unlisted.append(f"{m}:{line} reads {text}")
    return wrong, unlisted


def test_no_module_reads_another_modules_private_attributes():
    """Issue 24: registry.py read ``config._given``. A private attribute read on anything but ``self``,
    ``cls`` or ``super()`` must be one the reading module defines itself; one that another fastdata
    module defines is a cross-module read (make it public there); one that no fastdata module defines
    belongs to another library and is listed, with its reason, in THIRD_PARTY_PRIVATE."""
    wrong, unlisted = _cross_module_private_reads()
    wrong = [message for m, attr, message in wrong]
    assert not wrong, "private attributes read across modules:\n" + "\n".join(wrong)
    assert not unlisted, ("private attributes of other libraries, not in THIRD_PARTY_PRIVATE (say why, or use "
                          "a public API):\n" + "\n".join(unlisted))


def test_the_private_read_rule_flags_what_it_should():
    src = ("class A:\n    def f(self, other):\n        self._mine = 1\n        super()._base()\n"
           "        return other._theirs, getattr(other, '_also'), self._mine, other.__dict__\n")
    assert [(attr, text) for _, attr, text in _private_reads(ast.parse(src))] == [
        ("_theirs", "other._theirs"), ("_also", "getattr(other, '_also')")]
    assert {"A", "f", "_mine"} <= _defined(ast.parse(src)) and "_theirs" not in _defined(ast.parse(src))
    assert "_given" in _defined(ast.parse("object.__setattr__(self, '_given', {})"))


# ---------------------------------------------------------------------------------------- sizes
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 60


def code_lines(source_lines: list[str], node) -> int:
    """Lines of a function that hold code: its span without blank lines, comment lines and its
    docstring (nested functions count in their parent too)."""
    first = node.body[0]
    doc = set()
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        doc = set(range(first.lineno, first.end_lineno + 1))
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return sum(1 for n in range(start, node.end_lineno + 1)
               if n not in doc and source_lines[n - 1].strip() and not source_lines[n - 1].strip().startswith("#"))


def test_no_module_is_over_700_lines():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def _scripts() -> dict[str, Path]:
    """The examples' and benchmarks' own Python files (not benchmarks' caches or results), by dotted name:
    code users copy from and code that produces the published numbers, held to the package's rules."""
    root = PACKAGE.parent
    return {".".join(p.relative_to(root).with_suffix("").parts): p
            for folder in ("examples", "benchmarks") for p in sorted((root / folder).rglob("*.py"))
            if not {".cache", "results"} & set(p.relative_to(root / folder).parts)}


def _long_functions(files: dict[str, Path]) -> list[str]:
    long = []
    for m, p in files.items():
        text = p.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and (n := code_lines(lines, node)) > MAX_FUNCTION_LINES:
                long.append(f"{m}.{node.name}: {n}")
    return long


def test_no_function_is_over_60_lines_of_code():
    """In fastdata/ and, since issue 32, in examples/ and benchmarks/ too (they had functions of up to
    78 lines: the examples are what users copy, the benchmarks what the published numbers come from)."""
    assert {"examples.train_mnist", "benchmarks.common"} <= set(_scripts())
    long = _long_functions(_modules() | _scripts())
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code (docstring and comments aside): {long}"


def test_code_lines_leave_out_the_docstring_comments_and_blank_lines():
    src = 'def f():\n    """Doc\n    string."""\n\n    # why\n    a = 1\n    return a\n'
    assert code_lines(src.splitlines(), ast.parse(src).body[0]) == 3
