"""demb-io is usable by a serving or data team without torch."""

from __future__ import annotations

import subprocess
import sys


def test_importing_demb_io_imports_no_torch():
    code = "import sys, demb_io; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
