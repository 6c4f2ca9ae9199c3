"""The package's import graph read from its source with `ast`, and its cycles.

Every import statement counts: at module level, in functions and methods, under
`if TYPE_CHECKING:`, in try/except and conditional branches. An import in a function
runs later than one at the top, but it still says the module needs the other; a circle
of such needs is one design knot whichever of its imports happens to be deferred."""

from __future__ import annotations

import ast
import pathlib


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """dora_jax.envs.base for root/dora_jax/envs/base.py; a package for its __init__."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: pathlib.Path) -> bool:
    p = root.joinpath(*name.split("."))
    return (p / "__init__.py").is_file() or p.with_suffix(".py").is_file()


def _statements(tree: ast.Module, module_level: bool) -> list:
    """Every import statement of `tree`, or (`module_level`) those that run when the
    module is imported: not in function bodies or under `if TYPE_CHECKING:`."""
    if not module_level:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            type_checking = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
                node.test)
            todo += [c for c in ast.iter_child_nodes(node)
                     if not (type_checking and c in node.body)]
    return out


def imports_of(path: pathlib.Path, root: pathlib.Path, *,
               module_level: bool = False) -> set[str]:
    """The modules under `root` that `path` imports, wherever the statement stands
    (`module_level`: only where it runs at import). `from a import b` names module a.b
    when b is one, else a; relative imports are resolved against the file's package."""
    name, out = module_name(path, root), set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in _statements(ast.parse(path.read_text(), filename=str(path)), module_level):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = package[:len(package) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            out |= {f"{base}.{a.name}" if is_module(f"{base}.{a.name}", root) else base
                    for a in node.names}
    return {m for m in out if m and is_module(m, root)}


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (every import, see above), with
    the packages each runs on the way (importing a.b.c runs a.b's __init__ first). The
    top package (dora_jax/__init__.py imports nothing) and a module's own parent
    packages (always imported before it) are left out; a member that names its own
    package's __init__ in an import (`from dora_jax.envs import get`) imports that
    __init__ itself, which may import the member back: that edge stays in."""
    root = package.parent
    top = package.name
    graph = {}
    for path in sorted(package.rglob("*.py")):
        name = module_name(path, root)
        named = {m for m in imports_of(path, root) if m.startswith(top + ".")}
        # Importing a.b.c runs a/b/__init__.py first: an import of that package too.
        parents = {".".join(m.split(".")[:i]) for m in named
                   for i in range(2, m.count(".") + 1)}
        graph[name] = ({m for m in named if m != name}
                       | {p for p in parents if not name.startswith(p + ".")})
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted, in
    sorted order (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through a component, first module repeated last: a readable report
    of how the modules reach one another."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    todo = [start]
    while todo:  # breadth first from start back to start, inside the component
        node = todo.pop(0)
        for n in sorted(graph[node] & members):
            if n == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if n not in previous:
                previous[n] = node
                todo.append(n)
    return component


def report(graph: dict[str, set[str]]) -> str:
    """The cycles, one per line with one circle through each, or '' when none."""
    return "\n".join(f"{len(c)} modules: {', '.join(c)}\n  e.g. {' -> '.join(cycle_path(graph, c))}"
                     for c in cycles(graph))


def unit(module: str, names=()) -> str:
    """The part of the package a module belongs to, the unit the layers are made of:
    dora_jax.scheduler for dora_jax.scheduler.core, a top-level module for itself; but
    a package's members are a unit of their own, apart from its __init__, where
    `names` (the layers' units, without the top package) holds `package.*`."""
    top, *rest = module.split(".")
    if len(rest) > 1 and f"{rest[0]}.*" in names:
        return f"{top}.{rest[0]}.*"
    return ".".join([top, *rest[:1]])


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, tuple]],
                     allowed: dict[tuple[str, str], str]) -> list[str]:
    """Every import from a unit to one in a higher layer (`layers`, lowest first:
    (layer name, unit names without the top package)), less the `allowed`
    (importer, imported) module pairs; then every cycle among the units (the same
    layer's units may import one another, one way only), the allowed pairs left out."""
    rank = {name: i for i, (_, names) in enumerate(layers) for name in names}

    def key(m: str) -> str:
        return unit(m, rank).split(".", 1)[1]

    found = [f"{u} is in no layer" for u in sorted({unit(m, rank) for m in graph if "." in m})
             if u.split(".", 1)[1] not in rank]
    if found:
        return found
    units: dict[str, set[str]] = {}
    for m, imported in sorted(graph.items()):
        if "." not in m:
            continue
        for n in sorted(imported):
            if (m, n) in allowed or unit(m, rank) == unit(n, rank):
                continue
            units.setdefault(unit(m, rank), set()).add(unit(n, rank))
            a, b = key(m), key(n)
            if rank[a] < rank[b]:
                found.append(f"{m} imports {n}: {layers[rank[a]][0]} -> "
                             f"{layers[rank[b]][0]}, a layer above it")
    found += [f"the packages {', '.join(c)} import one another"
              for c in cycles({u: units.get(u, set())
                               for u in {unit(m, rank) for m in graph if "." in m}})]
    return found
