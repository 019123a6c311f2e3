"""Test-session setup shared by every test module.

OpenMP threads (torch's and our CPU attention kernel's) spin while waiting by default;
on a small, busy CI machine that made the engine tests 10-20x slower. Passive waiting
must be chosen before the OpenMP runtime starts, i.e. before anything imports torch.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
