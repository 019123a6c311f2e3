"""What machine a benchmark ran on, for the header line every benchmark prints: the
package's own `prefixcache.machine`, which `prefixcache bench` uses too.

Must never: measure anything.
"""

from __future__ import annotations

from prefixcache.machine import cpu_model

__all__ = ["cpu_model"]
