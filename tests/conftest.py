"""Test-session setup shared by every test module.

- OpenMP threads (torch's and our CPU attention kernel's) spin while waiting by default;
  on a small, busy CI machine that made the engine tests 10-20x slower. Passive waiting
  must be chosen before the OpenMP runtime starts, i.e. before anything imports torch.
- `examples/` goes on sys.path, so tests (and the YAML files they load) name the example
  plugins by "module:Class" path, exactly as a user names theirs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
