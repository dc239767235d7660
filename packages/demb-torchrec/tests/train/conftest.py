"""The ``demb train`` tests' shared module (``_job``) imports by name: pytest's importlib mode
puts no test directory on the path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
