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
    DynamicEmbPoolingMode,
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
    with pytest.raises(
        NotSupportedError, match=r"table 'user': DynamicEmbTableOptions\.external_storage"
    ):
        module(external_storage=object())
    frozen = module(training=False)
    with pytest.raises(TrainingStateError, match=r"tables \['user'\]: built with training=False"):
        frozen(torch.tensor([1]), torch.tensor([0, 1]))


BAD_BATCHES = {
    "indices": (torch.tensor([1, -1]), torch.tensor([0, 1, 2]), "the empty-key sentinel"),
    "offsets": (torch.tensor([1, 2]), torch.tensor([0, 2, 1]), "never decrease and end at 2"),
}


@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.NONE])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("argument", sorted(BAD_BATCHES))
def test_bad_batch_data_is_an_input_error_naming_the_argument_and_tables(
    pooling, training, argument
):
    """The batch's data checks run in the native ops (a -1 key, offsets that decrease), on
    every training and eval path: the module raises them as InputError naming the argument
    and the tables, and nothing is inserted."""
    tables = DynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=4, max_capacity=128)],
        table_names=["user"],
        pooling_mode=pooling,
        device="cpu",
    )
    tables.train(training)
    indices, offsets, reason = BAD_BATCHES[argument]
    with pytest.raises(InputError, match=reason) as caught:
        tables(indices, offsets)
    assert caught.value.argument == argument
    assert "['user']" in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)
    assert tables.tables.export(0).keys.numel() == 0
