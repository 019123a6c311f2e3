"""Saving and loading workloads in prefixcache's own JSONL format (exact round trip).

Line 1 is a header `{"prefixcache_workload": 1, "name", "generator", "params",
"analytic_exact"}`; each further line is one request `{"arrival_s", "namespace", "tag",
"prompt": [[start, stop], ...], "output": [[start, stop], ...]}` with tokens as the
canonical runs of `tokens.TokenRuns`, so a generated workload of millions of tokens is a
small file. A generator's analytic hit ratio is re-attached from the catalog on load.
For the Mooncake format see `mooncake.py`.

Must never: change a workload on the way (load(save(w)) == w).
"""

from __future__ import annotations

import json
from pathlib import Path

from prefixcache.workloads.catalog import analytic_for
from prefixcache.workloads.checks import parse_json_object
from prefixcache.workloads.tokens import TokenRuns
from prefixcache.workloads.workload import Request, Workload

__all__ = ["save_workload", "load_workload", "FORMAT_VERSION"]

FORMAT_VERSION = 1


def save_workload(path: str | Path, workload: Workload) -> None:
    """Write `workload` to `path` (JSONL, see the module docstring)."""
    header = {"prefixcache_workload": FORMAT_VERSION, "name": workload.name, "generator": workload.generator,
              "params": dict(workload.params), "analytic_exact": workload.analytic_exact}
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for r in workload.requests:
            f.write(json.dumps({"arrival_s": r.arrival_s, "namespace": r.namespace, "tag": r.tag,
                                "prompt": r.prompt.runs, "output": r.output.runs}) + "\n")


def load_workload(path: str | Path) -> Workload:
    """Read a workload written by `save_workload`; ValueError naming file:line on bad input."""
    with open(path, encoding="utf-8") as f:
        lines = [(lineno, line) for lineno, line in enumerate(f, 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty file; expected a prefixcache workload header line")
    first, line = lines[0]
    header = parse_json_object(f"{path}:{first}", line)
    if header.get("prefixcache_workload") != FORMAT_VERSION:
        raise ValueError(
            f"{path}:{first}: not a prefixcache workload header (need \"prefixcache_workload\": {FORMAT_VERSION})"
        )
    requests = []
    for lineno, line in lines[1:]:
        obj = parse_json_object(f"{path}:{lineno}", line)
        try:
            requests.append(Request(obj["arrival_s"], TokenRuns(map(tuple, obj["prompt"])),
                                    TokenRuns(map(tuple, obj["output"])), obj["namespace"], obj["tag"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: bad request ({type(e).__name__}: {e})") from None
    generator, params = header.get("generator", ""), header.get("params", {})
    return Workload(header.get("name", Path(path).stem), tuple(requests), generator, params,
                    analytic_for(generator, params), bool(header.get("analytic_exact", True)))

