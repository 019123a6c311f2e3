"""Test-session setup: `examples/` goes on sys.path, so tests (and the YAML files they
load) name the example plugins by "module:Class" path, exactly as a user names theirs."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
