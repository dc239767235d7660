"""InitializerArgs (defaults, complete(), validation), table_seed, and initialize_rows end to end
on the CPU against demb_kernels' reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from demb_kernels.init_reference import reference_rows
from demb_storage import (
    InitializerArgs,
    InitializerMode,
    TableConfigError,
    initialize_rows,
    table_seed,
)

M = InitializerMode


def test_defaults():
    args = InitializerArgs()
    assert args.mode is M.UNIFORM
    assert (args.mean, args.std_dev, args.lower, args.upper, args.value) == (
        0.0,
        1.0,
        None,
        None,
        0.0,
    )
    assert [m.value for m in M] == ["normal", "truncated_normal", "uniform", "constant", "debug"]


def test_string_mode_is_converted_and_args_are_mutable():
    args = InitializerArgs(mode="truncated_normal")  # type: ignore[arg-type]
    assert args.mode is M.TRUNCATED_NORMAL
    args.mean = 0.5
    assert args.mean == 0.5


@pytest.mark.parametrize("mode", [M.UNIFORM, M.TRUNCATED_NORMAL])
def test_complete_fills_missing_bounds(mode):
    args = InitializerArgs(mode=mode)
    done = args.complete(1_600_000)
    assert done.lower == -1 / math.sqrt(1.6e6)
    assert done.upper == 1 / math.sqrt(1.6e6)
    assert args.lower is None  # a copy
    assert args.upper is None
    kept = InitializerArgs(mode=mode, lower=-0.5).complete(100)
    assert (kept.lower, kept.upper) == (-0.5, 0.1)
    both = InitializerArgs(mode=mode, lower=1.0, upper=2.0).complete(4)
    assert (both.lower, both.upper) == (1.0, 2.0)


@pytest.mark.parametrize("mode", [M.NORMAL, M.CONSTANT, M.DEBUG])
def test_complete_leaves_other_modes(mode):
    args = InitializerArgs(mode=mode, mean=0.25)
    done = args.complete(10)
    assert done == args
    assert done is not args
    assert done.lower is None
    assert done.upper is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "gauss"}, r"initializer_args\.mode='gauss': expected an InitializerMode"),
        ({"mode": 3}, r"initializer_args\.mode=3"),
        ({"mean": math.nan}, r"initializer_args\.mean=nan: must be a finite number"),
        ({"std_dev": math.inf}, r"initializer_args\.std_dev=inf"),
        ({"value": "1"}, r"initializer_args\.value='1'"),
        ({"lower": True}, r"initializer_args\.lower=True"),
        ({"upper": -math.inf}, r"initializer_args\.upper=-inf"),
        ({"mode": M.NORMAL, "std_dev": 0.0}, r"initializer_args\.std_dev=0\.0: must be > 0"),
        ({"mode": M.TRUNCATED_NORMAL, "std_dev": -1}, r"initializer_args\.std_dev=-1"),
        ({"lower": 1.0, "upper": 1.0}, r"initializer_args\.lower=1\.0: must be < upper=1\.0"),
        ({"lower": 2.0, "upper": -2.0}, r"initializer_args\.lower=2\.0"),
    ],
)
def test_invalid_args_name_the_field(kwargs, match):
    with pytest.raises(TableConfigError, match=match):
        InitializerArgs(**kwargs)


def test_complete_validates():
    with pytest.raises(TableConfigError, match="num_embeddings=0: must be a positive integer"):
        InitializerArgs().complete(0)
    with pytest.raises(TableConfigError, match="num_embeddings=True"):
        InitializerArgs().complete(True)
    with pytest.raises(TableConfigError, match=r"initializer_args\.lower=2\.0: must be < upper"):
        InitializerArgs(lower=2.0).complete(100)  # the default upper 0.1 is below it
    assert issubclass(TableConfigError, ValueError)


def test_table_seed():
    seeds = {table_seed(s, t) for s in range(50) for t in range(50)}
    assert len(seeds) == 2500
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert table_seed(7, 3) == table_seed(7, 3) == table_seed(7 + 2**64, 3)
    assert table_seed(0, 0) != 0
    with pytest.raises(TableConfigError, match="table_index=-1"):
        table_seed(0, -1)
    with pytest.raises(TableConfigError, match=r"seed=1\.5"):
        table_seed(1.5, 0)  # type: ignore[arg-type]


def test_table_seed_bits_are_balanced():
    bits = np.array([table_seed(12345, t) & ((1 << 64) - 1) for t in range(4000)], dtype=np.uint64)
    ones = np.array([(bits >> np.uint64(b)) & np.uint64(1) for b in range(64)]).mean(axis=1)
    assert np.all(np.abs(ones - 0.5) < 0.05)


@pytest.mark.parametrize(
    "args",
    [
        InitializerArgs(),
        InitializerArgs(mode=M.TRUNCATED_NORMAL, mean=0.01),
        InitializerArgs(mode=M.NORMAL, mean=-1.0, std_dev=0.1),
        InitializerArgs(mode=M.CONSTANT, value=0.75),
        InitializerArgs(mode=M.DEBUG),
    ],
    ids=lambda a: a.mode.value,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_initialize_rows_end_to_end(args, dtype):
    num_embeddings, dim, state_dim = 1000, 6, 2
    done = args.complete(num_embeddings)
    seed = table_seed(2024, 1)
    keys = [3, -7, 2**40 + 1, 999]
    values = torch.full((8, dim + state_dim), -9.0, dtype=dtype)
    slots = torch.tensor([5, 0, -1, 2])
    state = torch.tensor([0.5, 0.25])
    initialize_rows(values, slots, torch.tensor(keys), dim, done, seed, state)
    lower = 0.0 if done.lower is None else done.lower
    upper = 1.0 if done.upper is None else done.upper
    ref = reference_rows(
        keys, dim, seed, done.mode.value, done.mean, done.std_dev, lower, upper, done.value
    )
    expected = torch.from_numpy(ref.astype(np.float32)).to(dtype)
    torch.testing.assert_close(values[[5, 0, 2], :dim], expected[[0, 1, 3]], rtol=1e-6, atol=0)
    assert torch.equal(values[[5, 0, 2], dim:], state.to(dtype).expand(3, 2))
    untouched = [1, 3, 4, 6, 7]
    assert torch.equal(values[untouched], torch.full((5, dim + state_dim), -9.0, dtype=dtype))
    if done.mode in (M.UNIFORM, M.TRUNCATED_NORMAL):
        bound = 1 / math.sqrt(num_embeddings)
        assert values[[5, 0, 2], :dim].abs().max() <= bound


@pytest.mark.parametrize("mode", [M.UNIFORM, M.TRUNCATED_NORMAL])
def test_initialize_rows_needs_complete_bounds(mode):
    values = torch.zeros(2, 3)
    with pytest.raises(TableConfigError, match=r"initializer_args\.lower=None: .*complete\("):
        initialize_rows(values, torch.tensor([0]), torch.tensor([1]), 3, InitializerArgs(mode), 0)
    half = InitializerArgs(mode, lower=-1.0)
    with pytest.raises(TableConfigError, match=r"initializer_args\.upper=None"):
        initialize_rows(values, torch.tensor([0]), torch.tensor([1]), 3, half, 0)
    assert torch.equal(values, torch.zeros(2, 3))
