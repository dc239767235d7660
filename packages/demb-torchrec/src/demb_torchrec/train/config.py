"""The settings of ``demb train`` / ``demb serve``: a TOML file (``--config``), then ``--set
section.key=value`` overrides and the dedicated flags, checked before anything is built.

Sections and keys (defaults in :data:`DEFAULTS`)::

    [data]      path (empty: the built-in synthetic stream), batch_size (global, all ranks),
                eval_samples, eval_fraction (the held-out tail of a data file), seed,
                scale (synthetic vocabulary scale), drift (synthetic drift per step)
    [train]     steps, log_every, eval_every, dense_lr, dim, bottom_mlp, top_mlp
    [optimizer] the dynamic tables' optimizer: kind (sgd, adam, adagrad, rowwise_adagrad,
                ftrl), lr, and its knobs (eps, beta1, beta2, weight_decay,
                initial_accumulator_value, l1_reg, l2_reg, learning_rate_power, ftrl_beta,
                gradient_clipping, max_gradient: demb-optim's names), checked when built
    [tables]    every table: capacity, init_capacity, bucket_capacity, max_load_factor,
                score_strategy (STEP, TIMESTAMP, LFU, TIMESTAMP+LFU), evicted_item_mode,
                dist_type, initializer, init_std; admit_strategy (none, frequency,
                probabilistic) with admit_threshold (frequency), admit_probability
                (probabilistic) and counter_capacity (the frequency counter's keys per
                table and rank); score_function ("module:function", TIMESTAMP+LFU
                only); a device budget, global_hbm_for_values (bytes, all ranks) or
                hbm_fraction (of the table's value bytes; default 1.0, all on the
                device; 0: all in host memory): alone, below the table, a hybrid table,
                with caching (true) the size of a device cache over a host table; and
                external_storage (a directory: the rows below the cache in RocksDB, the
                ``ssd`` extra); the option the planner sets
                (local_hbm_for_values) or that the specification deprecates
                (admission_counter): setting one fails naming it
    [tables.cat_N]  the same keys for one table (cat_0 ... cat_25)
    [online]    delta_every, ckpt_every, blocking_ckpt
    [output]    dir (logs, plots, deltas, checkpoints), tensorboard

Every key is checked: an unknown one, a wrong type or a value out of range raises
:class:`~demb_torchrec.errors.ConfigError` naming ``section.key``.
"""

from __future__ import annotations

import copy
import importlib
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from demb_torchrec.errors import ConfigError
from demb_torchrec.train.batch import NUM_SPARSE

__all__ = [
    "DEFAULTS",
    "DEPRECATED",
    "NOT_BUILT",
    "Settings",
    "load_settings",
    "parse_override",
    "resolve_function",
]

DEFAULTS: dict[str, dict[str, Any]] = {
    "data": {
        "path": "",
        "batch_size": 512,
        "eval_samples": 8192,
        "eval_fraction": 0.05,
        "seed": 0,
        "scale": 0.05,
        "drift": 2.0,
    },
    "train": {
        "steps": 6000,
        "log_every": 100,
        "eval_every": 500,
        "dense_lr": 0.003,
        "dim": 16,
        "bottom_mlp": [64, 16],
        "top_mlp": [64, 32, 1],
    },
    "optimizer": {"kind": "adam", "lr": 0.01},
    "tables": {
        "capacity": 8192,
        "init_capacity": 0,
        "bucket_capacity": 128,
        "max_load_factor": 0.5,
        "score_strategy": "STEP",
        "evicted_item_mode": "DISCARD",
        "dist_type": "roundrobin",
        "initializer": "uniform",
        "init_std": 0.05,
        "admit_strategy": "none",
        "admit_threshold": 3,
        "admit_probability": 0.5,
        "counter_capacity": 65536,
        "score_function": "",
        "caching": False,
        "global_hbm_for_values": 0,
        "hbm_fraction": 1.0,
        "external_storage": "",
    },
    "online": {"delta_every": 500, "ckpt_every": 2000, "blocking_ckpt": False},
    "output": {"dir": "demb-train-out", "tensorboard": True},
}
"""Every setting and its default (``tables.init_capacity`` 0: the capacity)."""

DEPRECATED: dict[str, str] = {
    "admission_counter": (
        "deprecated by the specification (the counter belongs to the strategy): "
        "set tables.counter_capacity"
    ),
}
"""Table options the specification deprecates: setting one fails, saying what to set."""

NOT_BUILT: dict[str, str] = {
    "local_hbm_for_values": (
        "the planner sets it per rank from global_hbm_for_values: set that, or tables.hbm_fraction"
    ),
}
"""Table options of the specification ``demb train`` does not take: setting one fails before
training, naming it and what to set instead."""

_CLIP = {"gradient_clipping", "max_gradient"}
_OPTIMIZER_KNOBS = {
    "sgd": _CLIP,
    "adam": {"eps", "beta1", "beta2", "weight_decay"} | _CLIP,
    "adagrad": {"eps", "initial_accumulator_value"} | _CLIP,
    "rowwise_adagrad": {"eps", "initial_accumulator_value"} | _CLIP,
    "ftrl": {"l1_reg", "l2_reg", "learning_rate_power", "ftrl_beta", "initial_accumulator_value"}
    | _CLIP,
}
"""The knobs of each optimizer kind besides ``lr`` (demb-optim's hyper-parameter names)."""
_SCORES = ("STEP", "TIMESTAMP", "LFU", "TIMESTAMP+LFU")
_ADMISSION = ("none", "frequency", "probabilistic")
_POSITIVE = {
    "data.batch_size",
    "data.eval_samples",
    "train.steps",
    "train.log_every",
    "train.eval_every",
    "train.dim",
    "tables.capacity",
    "tables.bucket_capacity",
    "tables.admit_threshold",
    "tables.counter_capacity",
}
_NON_NEGATIVE = {
    "data.seed",
    "tables.init_capacity",
    "tables.global_hbm_for_values",
    "online.delta_every",
    "online.ckpt_every",
}


class Settings:
    """Checked settings: ``settings["train"]["steps"]``; :meth:`table` merges a table's own
    section over ``[tables]``."""

    def __init__(self, values: Mapping[str, Mapping[str, Any]]) -> None:
        self.values: dict[str, dict[str, Any]] = {k: dict(v) for k, v in values.items()}
        self.table_overrides: dict[str, dict[str, Any]] = {
            k: dict(v) for k, v in values["tables"].items() if isinstance(v, Mapping)
        }
        for name in self.table_overrides:
            del self.values["tables"][name]

    def __getitem__(self, section: str) -> dict[str, Any]:
        return self.values[section]

    def table(self, name: str) -> dict[str, Any]:
        """The settings of table ``name``: ``[tables]`` with ``[tables.<name>]`` over it."""
        return {**self.values["tables"], **self.table_overrides.get(name, {})}

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """The settings as TOML-able sections (table overrides under ``tables``)."""
        out = copy.deepcopy(self.values)
        out["tables"].update(copy.deepcopy(self.table_overrides))
        return out

    @property
    def output(self) -> Path:
        return Path(self.values["output"]["dir"])


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` (the value in TOML syntax; a bare word is a string) as its key path
    and value.

    Raises:
        ConfigError: no ``=``, or no section.
    """
    key, sep, raw = text.partition("=")
    path = [p.strip() for p in key.strip().split(".")]
    if not sep or len(path) < 2 or not all(path):
        raise ConfigError(f"--set {text!r}: expected section.key=value (e.g. train.steps=500)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def load_settings(
    config: Path | None = None, overrides: Sequence[tuple[Sequence[str], Any]] = ()
) -> Settings:
    """The defaults, with the TOML file ``config`` and then ``overrides`` (key path, value)
    over them, checked.

    Raises:
        ConfigError: an unreadable file; an unknown section or key; a value of the wrong type
            or out of range; a table option demb does not have yet (:data:`NOT_BUILT`); the
            message names ``section.key``.
    """
    values = copy.deepcopy(DEFAULTS)
    if config is not None:
        try:
            loaded = tomllib.loads(Path(config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"--config {config}: {err}") from None
        for section, body in loaded.items():
            if not isinstance(body, dict):
                raise ConfigError(f"{config}: {section!r} must be a [section]")
            for key, value in body.items():
                _put(values, [section, key], value)
    for path, value in overrides:
        _put(values, list(path), value)
    _check(values)
    return Settings(values)


def _put(values: dict[str, dict[str, Any]], path: list[str], value: object) -> None:
    section = path[0]
    if section not in values:
        raise ConfigError(f"{'.'.join(path)}: unknown section {section!r} (has {sorted(values)})")
    if section == "tables" and len(path) == 3:
        name, key = path[1], path[2]
        values["tables"].setdefault(name, {})[key] = value
        return
    if section == "tables" and len(path) == 2 and isinstance(value, dict):
        for key, v in value.items():
            values["tables"].setdefault(path[1], {})[key] = v
        return
    if len(path) != 2:
        raise ConfigError(f"{'.'.join(path)}: expected section.key")
    values[section][path[1]] = value


def _check(values: dict[str, dict[str, Any]]) -> None:
    for section, body in values.items():
        for key, value in body.items():
            if section == "tables" and isinstance(value, dict):
                _check_table_name(key)
                for k, v in value.items():
                    _check_value(f"tables.{key}.{k}", "tables", k, v)
            else:
                _check_value(f"{section}.{key}", section, key, value)
    kind = values["optimizer"]["kind"]
    if kind not in _OPTIMIZER_KNOBS:
        raise ConfigError(f"optimizer.kind={kind!r}: one of {sorted(_OPTIMIZER_KNOBS)}")
    knobs = set(values["optimizer"]) - {"kind", "lr"}
    unknown = knobs - _OPTIMIZER_KNOBS[kind]
    if unknown:
        raise ConfigError(
            f"optimizer.{sorted(unknown)[0]}: not a setting of {kind} "
            f"(it takes lr, {', '.join(sorted(_OPTIMIZER_KNOBS[kind])) or 'nothing else'})"
        )
    _check_tiers(values)
    if values["train"]["top_mlp"][-1] != 1:
        raise ConfigError("train.top_mlp: the last layer must have 1 output (the click logit)")
    if values["train"]["bottom_mlp"][-1] != values["train"]["dim"]:
        raise ConfigError(
            f"train.bottom_mlp: the last layer must have train.dim={values['train']['dim']} "
            "outputs (DLRM interacts it with the embeddings)"
        )


def _check_tiers(values: dict[str, dict[str, Any]]) -> None:
    """Each table's memory settings agree: a budget in bytes or a fraction, and a cache has
    room on the device."""
    base = {k: v for k, v in values["tables"].items() if not isinstance(v, dict)}
    names = ["tables"] + [f"tables.{k}" for k, v in values["tables"].items() if isinstance(v, dict)]
    for where in names:
        own = values["tables"].get(where.removeprefix("tables."), {}) if "." in where else {}
        s = {**base, **own}
        if s["global_hbm_for_values"] and s["hbm_fraction"] != 1.0:
            raise ConfigError(
                f"{where}: set one of {where}.global_hbm_for_values (bytes) or "
                f"{where}.hbm_fraction (of the table's value bytes), not both (a budget in "
                f"bytes takes hbm_fraction at its default, 1.0)"
            )
        if not s["caching"]:  # a budget alone: a hybrid table
            if s["external_storage"]:
                raise ConfigError(
                    f"{where}.external_storage={s['external_storage']!r}: set "
                    f"{where}.caching=true (an external storage is the tier under a cache)"
                )
            continue
        if not (s["global_hbm_for_values"] or s["hbm_fraction"]):
            raise ConfigError(
                f"{where}.caching=true: set one of {where}.global_hbm_for_values (bytes) or "
                f"{where}.hbm_fraction (of the table's value bytes, not 0) for the device cache"
            )


def _check_table_name(name: str) -> None:
    valid = {f"cat_{i}" for i in range(NUM_SPARSE)}
    if name not in valid:
        raise ConfigError(f"tables.{name}: no such table (cat_0 ... cat_{NUM_SPARSE - 1})")


def _check_value(where: str, section: str, key: str, value: Any) -> None:  # noqa: ANN401 (a TOML value)
    if section == "tables" and key in DEPRECATED:
        raise ConfigError(f"{where}={value!r}: {DEPRECATED[key]}")
    if section == "tables" and key in NOT_BUILT:
        if value in (None, False, 0, ""):
            return
        raise ConfigError(f"{where}={value!r}: {NOT_BUILT[key]}")
    if section == "optimizer" and key != "kind":
        if key == "gradient_clipping":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}={value!r}: must be true or false")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}={value!r}: must be a number")
        return
    if key not in DEFAULTS[section]:
        raise ConfigError(f"{where}: unknown setting (the section has {sorted(DEFAULTS[section])})")
    default = DEFAULTS[section][key]
    _check_type(where, value, default)
    name = f"{section}.{key}"
    if name in _POSITIVE and value <= 0:
        raise ConfigError(f"{where}={value!r}: must be > 0")
    if name in _NON_NEGATIVE and value < 0:
        raise ConfigError(f"{where}={value!r}: must be >= 0")
    _check_special(where, name, value)


def _check_type(where: str, value: object, default: object) -> None:
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif isinstance(default, list):
        ok = (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        )
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"{where}={value!r}: must be like {default!r} ({type(default).__name__})")


def resolve_function(where: str, path: str) -> Callable[..., Any]:
    """The function a ``score_function`` setting names: ``package.module:function`` (or
    ``package.module.function``).

    Raises:
        ConfigError: the module cannot be imported or has no such callable.
    """
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ConfigError(f"{where}={path!r}: expected package.module:function")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}={path!r}: {err}") from None
    if not callable(found):
        raise ConfigError(f"{where}={path!r}: not a function")
    return cast("Callable[..., Any]", found)


def _check_special(where: str, name: str, value: Any) -> None:  # noqa: ANN401 (a TOML value)
    if name == "tables.score_strategy" and value not in _SCORES:
        raise ConfigError(f"{where}={value!r}: one of {', '.join(_SCORES)}")
    if name == "tables.evicted_item_mode" and value not in ("DISCARD", "RETAIN_KEY"):
        raise ConfigError(f"{where}={value!r}: DISCARD or RETAIN_KEY")
    if name == "tables.dist_type" and value not in ("roundrobin", "hash_roundrobin"):
        raise ConfigError(
            f"{where}={value!r}: roundrobin or hash_roundrobin (deltas route keys by "
            "(key or hash(key)) % world_size; continuous sharding has no deltas)"
        )
    if name == "tables.initializer" and value not in ("uniform", "normal", "truncated_normal"):
        raise ConfigError(f"{where}={value!r}: uniform, normal or truncated_normal")
    if name == "tables.admit_strategy" and value not in _ADMISSION:
        raise ConfigError(f"{where}={value!r}: one of {', '.join(_ADMISSION)}")
    if name == "tables.score_function" and value:
        resolve_function(where, value)
    if name == "tables.admit_probability" and not 0 < value <= 1:
        raise ConfigError(f"{where}={value!r}: must be in (0, 1] (0 would admit no key)")
    if name == "tables.hbm_fraction" and not 0 <= value <= 1:
        raise ConfigError(f"{where}={value!r}: must be in [0, 1] (0: no value rows on the device)")
    if name == "tables.max_load_factor" and not 0 < value <= 1:
        raise ConfigError(f"{where}={value!r}: must be in (0, 1]")
    if name in ("data.eval_fraction",) and not 0 < value < 1:
        raise ConfigError(f"{where}={value!r}: must be in (0, 1)")
    if name in ("train.dense_lr", "tables.init_std", "data.scale") and not value > 0:
        raise ConfigError(f"{where}={value!r}: must be > 0")
    if name == "data.drift" and value < 0:
        raise ConfigError(f"{where}={value!r}: must be >= 0")
