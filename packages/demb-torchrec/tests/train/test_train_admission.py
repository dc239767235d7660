"""``demb train`` with admission and a score function from its configuration: frequency
admission keeps most of the synthetic stream's once-seen ids out of the tables, the records
carry each table's admitted and rejected keys, ``admission.png`` is drawn; ``score_function``
names an importable function; bad settings fail before training, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from _job import SMALL, records, run
from demb_torchrec import FrequencyAdmissionStrategy, ProbabilisticAdmissionStrategy
from demb_torchrec.errors import ConfigError
from demb_torchrec.train.config import load_settings, parse_override
from demb_torchrec.train.model import table_options
from demb_torchrec.train.plots import ADMISSION_PNG
from demb_torchrec.train.score_functions import lru_lfu_decay_score


def settings(*overrides: str):
    return load_settings(None, [parse_override(o) for o in overrides])


def test_admission_settings_build_the_strategies() -> None:
    s = settings("tables.admit_strategy=frequency", "tables.admit_threshold=4")
    strategy = table_options(s, "cat_0").admit_strategy
    assert isinstance(strategy, FrequencyAdmissionStrategy)
    assert strategy.threshold == 4
    assert strategy.counter.capacity == 65536
    s = settings(
        "tables.admit_strategy=probabilistic",
        "tables.cat_3.admit_strategy=none",
        "tables.admit_probability=0.25",
    )
    strategy = table_options(s, "cat_0").admit_strategy
    assert isinstance(strategy, ProbabilisticAdmissionStrategy)
    assert strategy.probability == 0.25
    assert table_options(s, "cat_3").admit_strategy is None
    assert table_options(settings(), "cat_0").admit_strategy is None


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("tables.admit_strategy=often", "tables.admit_strategy"),
        ("tables.admit_threshold=0", "tables.admit_threshold"),
        ("tables.admit_probability=0.0", "tables.admit_probability"),
        ("tables.cat_2.admit_probability=1.5", "tables.cat_2.admit_probability"),
        ("tables.counter_capacity=0", "tables.counter_capacity"),
        ("tables.admission_counter=100", "tables.admission_counter"),
        ("tables.score_function='no_such_module:f'", "tables.score_function"),
        ("tables.score_function='math:no_such_function'", "tables.score_function"),
        ("tables.score_function='math:pi'", "tables.score_function"),
    ],
)
def test_bad_admission_settings_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        settings(override)


def test_score_function_settings_name_a_function_of_compound_tables() -> None:
    path = "demb_torchrec.train.score_functions:lru_lfu_decay_score"
    s = settings("tables.score_strategy='TIMESTAMP+LFU'", f"tables.score_function='{path}'")
    assert table_options(s, "cat_0").score_function is lru_lfu_decay_score
    assert table_options(settings(), "cat_0").score_function is None
    with pytest.raises(ConfigError, match=r"tables\.cat_0\.score_function.*TIMESTAMP\+LFU"):
        table_options(settings(f"tables.score_function='{path}'"), "cat_0")


def test_a_run_with_frequency_admission_records_and_plots_it(tmp_path: Path) -> None:
    """With a score function on every table too."""
    out = tmp_path / "run"
    args = [a if a != "120" else "20" for a in SMALL]  # 20 steps
    path = "demb_torchrec.train.score_functions:lru_lfu_decay_score"
    done = run(
        "--out", str(out), *args,
        "--set", "tables.admit_strategy=frequency", "--set", "tables.admit_threshold=2",
        "--set", "tables.score_strategy='TIMESTAMP+LFU'",
        "--set", f"tables.score_function='{path}'",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "missing keys admitted" in done.stdout
    found = records(out)
    tables = [t for r in found for t in r["tables"].values()]
    admitted = sum(t["admitted"] for t in tables)
    rejected = sum(t["rejected"] for t in tables)
    assert admitted > 0
    assert rejected > admitted  # most ids of a power-law stream turn up once
    assert all(t["inserts"] <= t["admitted"] for t in tables)  # only admitted keys go in
    assert (out / "plots" / ADMISSION_PNG).stat().st_size > 10_000
