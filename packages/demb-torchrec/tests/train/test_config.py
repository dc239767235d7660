"""``demb train`` settings: a TOML file, ``--set`` overrides and flags, every key checked before
anything is built (an unknown key, a wrong type, a value out of range, an option demb does not
have yet each name their setting), per-table sections, and the table options they make."""

from __future__ import annotations

from pathlib import Path

import pytest
from demb_torchrec import ConfigError, DynamicEmbScoreStrategy, EvictedItemMode
from demb_torchrec.train.cli import main_train
from demb_torchrec.train.config import DEFAULTS, NOT_BUILT, load_settings, parse_override
from demb_torchrec.train.model import table_options


def test_defaults_then_file_then_overrides(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        "[train]\nsteps = 50\n[tables]\ncapacity = 4096\nscore_strategy = 'TIMESTAMP'\n"
        "[tables.cat_7]\ncapacity = 1024\nevicted_item_mode = 'RETAIN_KEY'\n"
        "[optimizer]\nkind = 'rowwise_adagrad'\nlr = 0.1\ninitial_accumulator_value = 0.5\n"
    )
    s = load_settings(config, [parse_override("train.steps=70"), (["data", "seed"], 3)])
    assert s["train"]["steps"] == 70
    assert s["data"]["seed"] == 3
    assert s["data"]["batch_size"] == DEFAULTS["data"]["batch_size"]
    assert s.table("cat_0")["capacity"] == 4096
    assert s.table("cat_7")["capacity"] == 1024
    seven = table_options(s, "cat_7")
    assert seven.max_capacity == 1024
    assert seven.evicted_item_mode is EvictedItemMode.RETAIN_KEY
    assert seven.score_strategy is DynamicEmbScoreStrategy.TIMESTAMP
    assert table_options(s, "cat_0").evicted_item_mode is EvictedItemMode.DISCARD
    assert s.as_dict()["tables"]["cat_7"]["capacity"] == 1024


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train.stepz=3", "train.stepz"),
        ("trian.steps=3", "trian.steps"),
        ("train.steps=0", "train.steps"),
        ("train.steps='many'", "train.steps"),
        ("data.batch_size=1.5", "data.batch_size"),
        ("tables.score_strategy='LRU'", "tables.score_strategy"),
        ("tables.cat_99.capacity=5", "tables.cat_99"),
        ("tables.cat_2.max_load_factor=1.5", "tables.cat_2.max_load_factor"),
        ("tables.dist_type='continuous'", "tables.dist_type"),
        ("optimizer.kind='lamb'", "optimizer.kind"),
        ("optimizer.l1_reg=0.1", "optimizer.l1_reg"),
        ("train.top_mlp=[8, 2]", "train.top_mlp"),
        ("train.bottom_mlp=[8, 4]", "train.bottom_mlp"),
    ],
)
def test_a_bad_setting_is_named(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_settings(None, [parse_override(override)])


@pytest.mark.parametrize("key", sorted(NOT_BUILT))
def test_options_demb_train_does_not_take_fail_naming_them(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"tables\.cat_1\.{key}=.*global_hbm_for_values"):
        load_settings(None, [parse_override(f"tables.cat_1.{key}=1")])
    load_settings(None, [parse_override(f"tables.{key}=0")])  # unset values pass


CACHED = ["online.delta_every=0"]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["tables.caching=true", "tables.hbm_fraction=0", *CACHED],
            r"tables\.caching=true: set one of",
        ),
        (
            ["tables.caching=true", "tables.hbm_fraction=0.5", "tables.global_hbm_for_values=8"],
            r"tables: set one of .* not both",
        ),
        (["tables.external_storage='/tmp/x'"], r"tables\.external_storage=.*caching=true"),
        (["tables.hbm_fraction=1.5", "tables.caching=true"], r"hbm_fraction=1\.5"),
    ],
)
def test_caching_settings_agree(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_settings(None, [parse_override(o) for o in overrides])


def test_a_budget_without_caching_loads_a_hybrid_table() -> None:
    s = load_settings(None, [parse_override("tables.cat_3.hbm_fraction=0.5")])
    assert s.table("cat_3")["hbm_fraction"] == 0.5
    assert not s.table("cat_3")["caching"]


def test_caching_settings_load() -> None:
    overrides = ["tables.caching=true", "tables.hbm_fraction=0.25", *CACHED]
    s = load_settings(None, [parse_override(o) for o in overrides])
    assert s.table("cat_7")["caching"] is True
    assert s.table("cat_7")["hbm_fraction"] == 0.25


def test_a_bad_file_and_a_bad_override_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_settings(bad)
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        parse_override("steps=3")


def test_the_command_line_fails_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = ["--set", "tables.caching=true", "--set", "tables.hbm_fraction=0"]
    code = main_train(["--out", str(tmp_path), *overrides])
    assert code == 2
    err = capsys.readouterr().err
    assert "tables.caching" in err
    assert "global_hbm_for_values" in err
    assert not (tmp_path / "train.jsonl").exists()
    with pytest.raises(SystemExit) as exited:
        main_train(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for text in ("--config", "--delta-every", "--resume", "[tables]", "score_strategy"):
        assert text in out
