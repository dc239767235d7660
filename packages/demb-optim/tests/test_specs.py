"""Optimizer specs: defaults, state sizes and initial states, and hyper-parameter validation."""

from __future__ import annotations

import math

import pytest
import torch
from demb_optim import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    OptimizerConfigError,
    OptimizerKind,
    RowWiseAdagrad,
    optimizer_state_bytes,
)


def test_defaults_follow_fbgemm_and_the_spec():
    assert Adam().hyper_parameters() == {
        "learning_rate": 0.01,
        "gradient_clipping": False,
        "max_gradient": 1.0,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    ftrl = FTRL()
    assert (ftrl.learning_rate, ftrl.learning_rate_power, ftrl.ftrl_beta) == (0.01, -0.5, 0.0)
    assert (ftrl.l1_reg, ftrl.l2_reg, ftrl.initial_accumulator_value) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("spec", "dtype", "state_dim"),
    [
        (SGD(), torch.float32, 0),
        (Adam(), torch.float32, 16),
        (Adagrad(), torch.bfloat16, 8),
        (RowWiseAdagrad(), torch.float32, 4),
        (RowWiseAdagrad(), torch.float16, 8),
        (FTRL(), torch.float16, 16),
    ],
)
def test_state_dim_for_an_8_wide_embedding(spec, dtype, state_dim):
    assert spec.state_dim(8, dtype) == state_dim
    state = spec.initial_state(8, dtype)
    assert state.shape == (state_dim,)
    assert state.dtype == dtype


@pytest.mark.parametrize("value", [0.0, 0.25, 3.0])
def test_initial_accumulator_value_seeds_every_accumulator(value):
    assert Adagrad(initial_accumulator_value=value).initial_state(3).tolist() == [value] * 3
    assert RowWiseAdagrad(initial_accumulator_value=value).initial_state(3).tolist() == [
        value,
        0.0,
        0.0,
        0.0,
    ]
    assert FTRL(initial_accumulator_value=value).initial_state(2).tolist() == [0, 0, value, value]
    assert Adam().initial_state(2).tolist() == [0.0] * 4


@pytest.mark.parametrize(
    ("make", "field", "value"),
    [
        (lambda: SGD(learning_rate=0.0), "learning_rate", 0.0),
        (lambda: SGD(learning_rate=math.nan), "learning_rate", math.nan),
        (lambda: SGD(max_gradient=-1.0), "max_gradient", -1.0),
        (lambda: SGD(gradient_clipping=1), "gradient_clipping", 1),  # type: ignore[arg-type]
        (lambda: Adam(beta1=1.0), "beta1", 1.0),
        (lambda: Adam(beta2=-0.1), "beta2", -0.1),
        (lambda: Adam(eps=0.0), "eps", 0.0),
        (lambda: Adam(weight_decay=-1e-3), "weight_decay", -1e-3),
        (lambda: Adagrad(initial_accumulator_value=-1.0), "initial_accumulator_value", -1.0),
        (lambda: RowWiseAdagrad(eps=-1.0), "eps", -1.0),
        (lambda: FTRL(learning_rate=-0.1), "learning_rate", -0.1),
        (lambda: FTRL(learning_rate_power=0.5), "learning_rate_power", 0.5),
        (lambda: FTRL(ftrl_beta=-1.0), "ftrl_beta", -1.0),
        (lambda: FTRL(l1_reg=-1.0), "l1_reg", -1.0),
        (lambda: FTRL(l2_reg=math.inf), "l2_reg", math.inf),
        (lambda: FTRL(learning_rate="0.1"), "learning_rate", "0.1"),  # type: ignore[arg-type]
    ],
)
def test_bad_hyper_parameters_name_the_field_and_value(make, field, value):
    with pytest.raises(OptimizerConfigError, match=f"^{field}={value!r}: ") as info:
        make()
    assert isinstance(info.value, ValueError)
    assert info.value.field == field


def test_learning_rate_power_zero_is_allowed():
    assert FTRL(learning_rate_power=0.0).learning_rate_power == 0.0


STATE_CASES = [
    ("sgd", 0, 0),
    ("adam", 64, 32),
    ("adagrad", 32, 16),
    ("rowwise_adagrad", 16, 16),
    ("ftrl", 64, 32),
    ("exact_row_wise_adagrad", 16, 16),
    ("exact_sgd", 0, 0),
]


@pytest.mark.parametrize(("name", "fp32", "fp16"), STATE_CASES)
def test_optimizer_state_bytes_for_an_8_wide_row(name, fp32, fp16):
    assert optimizer_state_bytes(name, 8, 4) == fp32
    assert optimizer_state_bytes(name, 8, 2) == fp16


def test_optimizer_names_parse_like_fbgemm_enums():
    class EmbOptimType:
        value = "exact_adagrad"

    assert OptimizerKind.parse(EmbOptimType()) is OptimizerKind.ADAGRAD
    assert OptimizerKind.parse("FTRL") is OptimizerKind.FTRL
    with pytest.raises(OptimizerConfigError, match="optimizer='lamb'"):
        optimizer_state_bytes("lamb", 8)
    with pytest.raises(OptimizerConfigError, match="embedding_dtype_bytes=8"):
        optimizer_state_bytes("adam", 8, 8)
    with pytest.raises(OptimizerConfigError, match="embedding_dim=0"):
        optimizer_state_bytes("adam", 0)
