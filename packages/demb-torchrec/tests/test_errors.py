"""One exception hierarchy: every error demb raises on purpose derives from DembError and from
the built-in type its case fits, and names the table and the argument."""

from __future__ import annotations

import demb_io
import demb_optim
import demb_planner
import demb_storage
import demb_torchrec
import pytest
import torch
from demb_torchrec import (
    DembError,
    DynamicEmbeddingTables,
    DynamicEmbTableOptions,
    InputError,
    InputTypeError,
    NotSupportedError,
    TrainingStateError,
    errors,
)

BUILT_IN = {
    "FormatError": ValueError,
    "LayoutError": ValueError,
    "PlannerConfigError": ValueError,
    "OptimizerConfigError": ValueError,
    "TableConfigError": ValueError,
    "InsertFailedError": RuntimeError,
    "InputError": ValueError,
    "InputTypeError": TypeError,
    "ConfigError": ValueError,
    "CheckpointError": RuntimeError,
    "NotSupportedError": NotImplementedError,
    "TrainingStateError": RuntimeError,
}


def test_every_exported_error_is_a_demb_error_of_the_fitting_built_in_type():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, DembError), name
        assert getattr(demb_torchrec, name) is cls, name
        if name in BUILT_IN:
            assert issubclass(cls, BUILT_IN[name]), name
    assert set(BUILT_IN) <= set(errors.__all__)
    for package in (demb_planner, demb_io, demb_optim, demb_storage):
        for name in package.__all__:
            obj = getattr(package, name)
            if isinstance(obj, type) and issubclass(obj, Exception):
                assert issubclass(obj, DembError), f"{package.__name__}.{name}"


def module(**kwargs):
    options = [DynamicEmbTableOptions(dim=4, max_capacity=128, **kwargs)]
    return DynamicEmbeddingTables(options, table_names=["user"], device="cpu", optimizer="sgd")


def test_bad_module_inputs_name_the_argument():
    tables = module()
    with pytest.raises(InputTypeError, match="indices: must be a 1-D") as caught:
        tables(torch.tensor([[1.0]]), torch.tensor([0, 1]))
    assert caught.value.argument == "indices"
    two_features = DynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=4, max_capacity=128)], feature_table_map=[0, 0], device="cpu"
    )
    with pytest.raises(InputError, match="offsets: 2 entries; expected F") as bad:
        two_features(torch.tensor([1, 2]), torch.tensor([0, 2]))
    assert bad.value.argument == "offsets"
    with pytest.raises(InputError, match="pooling_weights: must be float32"):
        tables(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.ones(2, dtype=torch.float64))


def test_an_unbuilt_option_and_a_frozen_table_name_the_table():
    with pytest.raises(NotSupportedError, match=r"table 'user': DynamicEmbTableOptions\.caching"):
        module(caching=True)
    frozen = module(training=False)
    with pytest.raises(TrainingStateError, match=r"tables \['user'\]: built with training=False"):
        frozen(torch.tensor([1]), torch.tensor([0, 1]))
