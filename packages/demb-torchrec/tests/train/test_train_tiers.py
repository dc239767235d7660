"""``demb train`` with caching tables: a device cache of a fraction of each table over a host
table (or RocksDB), from its configuration; it prints where the values live, records and plots
what moved between the tiers, and checkpoints the rows of both tiers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _job import SMALL, records, run
from demb_storage import RocksDBStorage
from demb_torchrec.train.config import load_settings, parse_override
from demb_torchrec.train.model import table_options
from demb_torchrec.train.plots import TIERS_PNG

CACHED = ["--set", "tables.caching=true"]  # non-blocking checkpoints: the default


def test_caching_settings_build_the_options(tmp_path: Path) -> None:
    overrides = [
        "tables.caching=true", "tables.hbm_fraction=0.25",
        "tables.cat_2.global_hbm_for_values=65536",
        "tables.cat_2.hbm_fraction=1.0",  # the default: a budget in bytes takes it
    ]  # fmt: skip
    s = load_settings(None, [parse_override(o) for o in overrides])
    seven = table_options(s, "cat_7")
    assert seven.caching
    # a quarter of 8192 rows of 16 float32 with Adam's 32 state columns
    assert seven.global_hbm_for_values == 8192 * (16 + 32) * 4 // 4
    assert table_options(s, "cat_2").global_hbm_for_values == 65536
    if importlib.util.find_spec("rocksdict") is not None:
        rocks = load_settings(
            None,
            [
                *map(parse_override, overrides),
                parse_override(f"tables.external_storage='{tmp_path}'"),
            ],
        )
        assert isinstance(table_options(rocks, "cat_0").external_storage, RocksDBStorage)
        assert (tmp_path / "cat_0.rank0").is_dir()


@pytest.mark.parametrize("storage", ["host", pytest.param("rocksdb", marks=pytest.mark.slow)])
def test_a_run_with_caching_tables_records_and_plots_the_tiers(tmp_path: Path, storage: str):
    if storage == "rocksdb" and importlib.util.find_spec("rocksdict") is None:
        pytest.skip("rocksdict (extra 'ssd') missing")
    out = tmp_path / "run"
    args = [a if a != "120" else "20" for a in SMALL]  # 20 steps
    args[args.index("--eval-every") + 1] = "20"
    args[args.index("--delta-every") + 1] = "20"  # deltas of both tiers
    extra = (
        ["--set", f"tables.external_storage='{tmp_path / 'rocks'}'"] if storage == "rocksdb" else []
    )
    done = run("--out", str(out), *args, *CACHED, "--set", "tables.hbm_fraction=0.05", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "a cache of" in done.stdout
    assert "of keys found in the device caches" in done.stdout
    tables = [t for r in records(out) for t in r["tables"].values()]
    assert sum(t["storage_hits"] for t in tables) > 0
    assert sum(t["write_backs"] for t in tables) > 0
    assert max(t["stored"] for t in tables) > 0
    assert (out / "plots" / TIERS_PNG).stat().st_size > 10_000
    assert list((out / "ckpt").glob("*.tables"))
    assert list((out / "deltas").glob("*.pt"))


def test_a_budget_without_caching_builds_a_hybrid_table_option() -> None:
    s = load_settings(None, [parse_override("tables.cat_3.hbm_fraction=0.5")])
    hybrid = table_options(s, "cat_3")
    assert not hybrid.caching
    assert hybrid.global_hbm_for_values == 8192 * (16 + 32) * 4 // 2
    # by default every value row on the device; 0: none
    assert table_options(s, "cat_0").global_hbm_for_values == 8192 * (16 + 32) * 4
    none = load_settings(None, [parse_override("tables.hbm_fraction=0")])
    assert table_options(none, "cat_0").global_hbm_for_values == 0


@pytest.mark.skipif(importlib.util.find_spec("rocksdict") is None, reason="rocksdict missing")
def test_an_external_storage_path_that_is_not_writable_names_the_table() -> None:
    overrides = [
        "tables.caching=true", "tables.hbm_fraction=0.1",
        "tables.external_storage='/proc/nowhere'",
    ]  # fmt: skip
    s = load_settings(None, [parse_override(o) for o in overrides])
    with pytest.raises(ValueError, match=r"cat_0\.rank0.*not a writable directory.*'cat_0'"):
        table_options(s, "cat_0")
