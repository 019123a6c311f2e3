"""The layering of docs/architecture.md ("Layers"), checked on the source: no module
imports one in a layer above its own, and the import graph has no cycle at all.

The graph is read with `ast` from every file of `prefixcache/` and `backends/` (installed
as `prefixcache.backends`), nothing imported. Every import counts, at module level or
inside a function: a function-level import runs as surely as a top-level one, only
later, so it cannot hide an arrow pointing up or close a cycle. `from prefixcache import
x` is an arrow to the submodule `prefixcache.x` when there is one, else to the package
`prefixcache` (the facade). Two kinds of import are left out, and why:

- imports under `if TYPE_CHECKING:` never run; they name types for annotations only.
  They are left out of the cycle check (they cannot take part in an import cycle) but
  kept in the layer check (a type from a higher layer is still a dependency on it).
- the implicit import of a module's parent packages (importing `prefixcache.config`
  first runs `prefixcache/__init__`): Python starts the parent before the child, so a
  package that imports its own children forms no cycle with them.
"""

from __future__ import annotations

import ast
import fnmatch
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {
    "prefixcache": ROOT / "prefixcache",
    "prefixcache.backends": ROOT / "backends",
}
NATIVE = "prefixcache._C"

# Lowest first; a module may import its own layer and those below it. Mirrors the
# diagram of docs/architecture.md, bottom to top, with the package `prefixcache` (the
# facade: `build_cache`, `load_cache` and the names re-exported from the core) as its
# own layer just above the core it re-exports.
LAYERS: list[tuple[str, list[str]]] = [
    ("native core", [NATIVE]),
    (
        "shared core",
        [
            "prefixcache.errors",
            "prefixcache.limits",
            "prefixcache.tier_config",
            "prefixcache.layout",
            "prefixcache.config",
            "prefixcache.protocol",
            "prefixcache.eviction",
            "prefixcache.registry",
            "prefixcache.config_checks",
            "prefixcache.hashing",
            "prefixcache.isolation",
            "prefixcache.block_contents",
            "prefixcache.evictors",
            "prefixcache.events",
            "prefixcache.event_wire",
            "prefixcache.event_subscriber",
            "prefixcache.machine",
            "prefixcache.tables",
            "prefixcache.percentiles",
            "prefixcache.service_model",
            "prefixcache.stats",
            "prefixcache.state_cap",
            "prefixcache.requests",
            "prefixcache.tier_file",
            "prefixcache.tiers",
            "prefixcache.attention",
            "prefixcache._attention_cuda",
            "prefixcache.testing",
            "prefixcache.testing_hybrid",
            "prefixcache.stress",
        ],
    ),
    ("facade", ["prefixcache"]),
    ("strategies", ["prefixcache.backends", "prefixcache.backends.*"]),
    ("engine", ["prefixcache.engine", "prefixcache.engine.*"]),
    (
        "experiments",
        [
            "prefixcache.ab",
            "prefixcache.ab_config",
            "prefixcache.ab_report",
            "prefixcache.workloads",
            "prefixcache.workloads.*",
        ],
    ),
    ("cluster", ["prefixcache.cluster", "prefixcache.cluster.*"]),
    (
        "serving",
        [
            "prefixcache.serve",
            "prefixcache.serve.*",
            "prefixcache.loadgen",
            "prefixcache.loadgen.*",
        ],
    ),
    ("CLI", ["prefixcache.cli", "prefixcache.overrides"]),
]


def modules() -> dict[str, Path]:
    """Module name -> source file, for every .py file of the package."""
    out = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = modules()
KNOWN = set(MODULES) | {NATIVE}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _ours(name: str) -> str | None:
    """The module of ours that importing `name` runs (itself or its closest parent)."""
    while name and name not in KNOWN:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported module of ours, line, under TYPE_CHECKING) for every import in `module`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend(
                    (m, child.lineno, type_only)
                    for a in child.names
                    if (m := _ours(a.name))
                )
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[
                        : len(package.split(".")) - (child.level - 1)
                    ]
                    base = ".".join(
                        [*anchor, *([child.module] if child.module else [])]
                    )
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in KNOWN else _ours(base)
                    if target:
                        out.append((target, child.lineno, type_only))
            visit(
                child,
                type_only or (isinstance(child, ast.If) and _is_type_checking(child)),
            )

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return [(m, line, type_only) for m, line, type_only in out if m != module]


def layer_of(module: str) -> int:
    found = [
        i
        for i, (_, patterns) in enumerate(LAYERS)
        for p in patterns
        if fnmatch.fnmatchcase(module, p)
    ]
    assert len(set(found)) == 1, (
        f"{module} is in {len(set(found))} layers of LAYERS; it must be in exactly one"
    )
    return found[0]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_every_module_is_in_one_layer():
    assert MODULES, "found no sources"
    for module in sorted(KNOWN):
        layer_of(module)
    unused = [
        p
        for _, patterns in LAYERS
        for p in patterns
        if not any(fnmatch.fnmatchcase(m, p) for m in KNOWN)
    ]
    assert not unused, f"LAYERS names modules that do not exist: {unused}"


def test_no_module_imports_one_in_a_layer_above_it():
    bad: list[str] = []
    for module in sorted(MODULES):
        mine = layer_of(module)
        for target, line, _ in imports(module):
            if layer_of(target) > mine:  # one line per import statement, not per name it imports
                bad.append(
                    f"{MODULES[module].relative_to(ROOT)}:{line}: {module} ({LAYERS[mine][0]}) imports "
                    f"{target} ({LAYERS[layer_of(target)][0]})"
                )
    assert not bad, "imports pointing up:\n" + "\n".join(dict.fromkeys(bad))


def test_the_import_graph_has_no_cycle():
    graph = {m: {t for t, _, type_only in imports(m) if not type_only} for m in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "graph, cyclic",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": set(), "b": {"c"}, "c": {"b"}}, True),
    ],
)
def test_find_cycle_finds_cycles(graph, cyclic):
    cycle = find_cycle(graph)
    assert (cycle is not None) == cyclic
    if cycle:
        assert cycle[0] == cycle[-1] and all(
            b in graph[a] for a, b in itertools.pairwise(cycle)
        )


def test_imports_reads_function_level_and_relative_imports():
    found = {m for m, _, _ in imports("prefixcache.cli")}
    assert "prefixcache.ab" in found  # imported inside a command's function
    assert ("prefixcache._C", False) in {
        (m, t) for m, _, t in imports("prefixcache.protocol")
    }


def test_layers_mirror_the_architecture_diagram():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    diagram = section.split("```\n", 2)[1]
    # A row of the diagram starts with its layer's name in the first 17 columns.
    rows = [line[:17].strip() for line in diagram.splitlines() if line[:17].strip()]
    names = [name for name, _ in LAYERS]
    assert [row for row in rows if row in names] == names[::-1], (
        f"docs/architecture.md's layers, top down: {rows}; LAYERS, bottom up: {names}"
    )
