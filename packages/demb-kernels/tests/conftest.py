"""Shared setup of the demb-kernels tests."""

from __future__ import annotations

import sys
from pathlib import Path

# The tests' shared modules (``_opcheck_inputs``, ...) import by name: pytest's importlib mode
# puts no test directory on the path.
sys.path.insert(0, str(Path(__file__).parent))
