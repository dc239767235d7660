"""Fixtures of the demb-torchrec tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def registry() -> Iterator[None]:
    """TorchRec's optimizer class-to-type table is left as the test found it: an FTRL entry a
    test made (constructing FTRL registers it) is undone in teardown, so no later test in the
    process sees FTRL registered by accident."""
    from demb_torchrec.optimizers import (
        FTRL,
        register_ftrl_emb_opt_type,
        unregister_ftrl_emb_opt_type,
    )
    from torchrec.distributed.utils import _OPTIMIZER_CLASS_TO_EMB_OPT_TYPE

    had = FTRL in _OPTIMIZER_CLASS_TO_EMB_OPT_TYPE
    yield
    if had:
        register_ftrl_emb_opt_type()
    else:
        unregister_ftrl_emb_opt_type()
