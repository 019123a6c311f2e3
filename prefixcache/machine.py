"""What machine this runs on, for the header line benchmarks and `prefixcache bench` print.

Must never: measure anything.
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()
