"""The dependency rules of the workspace that code review alone would not catch."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["demb_planner"])
def test_importing_planner_and_io_imports_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_package_declares_all():
    import demb_io
    import demb_kernels
    import demb_optim
    import demb_planner
    import demb_storage
    import demb_torchrec

    for module in (demb_planner, demb_io, demb_kernels, demb_optim, demb_storage, demb_torchrec):
        exported = module.__all__
        assert all(hasattr(module, name) for name in exported), module.__name__
