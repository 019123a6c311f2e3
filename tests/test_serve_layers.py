"""What each new layer pulls in when imported: the arrows run down, the extras stay optional.

The first checks import a module in a fresh interpreter and look at `sys.modules`; the
last reads the import statements of whole packages (no torch import needed).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "prefixcache"

HEAVY = ("torch", "zmq", "msgspec", "fastapi", "uvicorn", "prometheus_client", "httpx", "openai")


def loaded(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout))


def tops(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


@pytest.mark.parametrize("module, allowed, forbidden_packages", [
    ("prefixcache", (), ("prefixcache.serve", "prefixcache.loadgen", "prefixcache.engine", "prefixcache.event_wire")),
    ("prefixcache.event_wire", ("msgspec",), ("prefixcache.serve", "prefixcache.engine")),
    ("prefixcache.event_subscriber", ("msgspec", "zmq"), ("prefixcache.serve", "prefixcache.engine")),
    ("prefixcache.serve.config", (), ("prefixcache.serve.server", "prefixcache.serve.app")),
    ("prefixcache.loadgen.cli", ("httpx",), ("prefixcache.serve", "prefixcache.engine.engine")),
])
def test_imports_stay_in_their_layer(module, allowed, forbidden_packages):
    mods = loaded(module)
    assert not (tops(mods) & set(HEAVY)) - set(allowed), f"{module} imports {sorted((tops(mods) & set(HEAVY)) - set(allowed))}"
    bad = sorted(m for m in mods for f in forbidden_packages if m == f or m.startswith(f + "."))
    assert not bad, f"{module} imports {bad}"


def imported_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize("files, forbidden", [
    ("engine/*.py", ("prefixcache.serve", "prefixcache.loadgen", "prefixcache.cluster")),
    ("event*.py", ("prefixcache.engine", "prefixcache.serve", "prefixcache.loadgen", "prefixcache.cluster")),
    ("loadgen/*.py", ("prefixcache.serve", "prefixcache.engine.engine", "prefixcache.cluster", "torch")),
])
def test_no_module_imports_a_layer_above_it(files, forbidden):
    for path in sorted(PACKAGE.glob(files)):
        bad = sorted(n for n in imported_names(path) for f in forbidden if n == f or n.startswith(f + "."))
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {bad}"
