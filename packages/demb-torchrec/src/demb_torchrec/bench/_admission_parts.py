"""The parts of ``demb bench admission`` (:mod:`demb_torchrec.bench.admission_bench`): the
batches with new keys of figure 1, figure 2 (the admission counter beside the hash table), and
the printed report.

Figure 2: both sides are ``T`` fused tables of the same slots and bucket width scoring by LFU:
the counter is a :class:`~demb_storage.MultiTableKVCounter` of the admission's ``KVCounter``,
the table a :class:`~demb_storage.ScoredHashTable` of LFU tables of dim 1 whose value rows are
never touched (``zero_new_rows=False``), so both do the index's work alone. Each step takes one
base batch's unique (key, table) pairs with their frequencies; both are emptied first
(untimed), so they stay under their capacity and never evict. ``new keys`` times the call that
inserts every pair, ``keys present`` a second call with the same pairs (all found, counts
added). The two sides alternate call by call, the one going first alternating step by step;
each call is timed between CUDA events (the wall clock on the CPU).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from demb_kernels.table import InsertStatus
from demb_storage import KVCounter, MultiTableKVCounter, ScoredHashTable, TableConfig

from demb_torchrec.bench._delta_report import figure
from demb_torchrec.bench.compare import seconds_of
from demb_torchrec.bench.workload import Workload, make_batches
from demb_torchrec.options import DynamicEmbScoreStrategy

__all__ = ["REGIMES", "AdmissionCheckError", "NewKeyBatches", "counter_figures", "print_report"]

REGIMES = ("new keys", "keys present")
_BATCHES = 4
_SIDES = ("counter", "table")

Batch = tuple[torch.Tensor, torch.Tensor]
Pairs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class AdmissionCheckError(RuntimeError):
    """A figure whose work was not what it should be: admission that asked about other keys
    than the new ones or rejected none, a counter or table op with other results, tables that
    did not evict."""


class NewKeyBatches:
    """The reference workload's batches (NONE pooling) with ``share`` of each table's unique ids
    replaced by ids never seen before. Step ``s`` takes base batch ``s % 4`` and maps its chosen
    ids to ``rows + s * span + j`` (``j``: the id's rank among its table's chosen ones,
    ``span``: the most a table's chosen ids of any base batch), so each step's new ids are a
    fresh range and a new key keeps its id's frequency in the batch."""

    def __init__(self, ref: Workload, device: torch.device, seed: int, share: float) -> None:
        gen = torch.Generator().manual_seed(seed + 1)
        self.rows = ref.rows
        self.base: list[Batch] = []
        self.ranks: list[torch.Tensor] = []
        self.new_keys: list[list[int]] = []
        """Per base batch, the new keys of each table."""
        self.unique_keys: list[list[int]] = []
        """Per base batch, the unique keys of each table."""
        for indices, offsets in make_batches(ref, _BATCHES, torch.device("cpu"), seed):
            per_table = indices.view(ref.tables, ref.samples)
            ranks = torch.full_like(per_table, -1)
            new, unique = [], []
            for t in range(ref.tables):
                ids, inverse = torch.unique(per_table[t], return_inverse=True)
                chosen = round(share * ids.numel())
                rank = torch.full_like(ids, -1)
                rank[torch.randperm(ids.numel(), generator=gen)[:chosen]] = torch.arange(chosen)
                ranks[t] = rank[inverse]
                new.append(chosen)
                unique.append(int(ids.numel()))
            self.base.append((indices.to(device), offsets.to(device)))
            self.ranks.append(ranks.view(-1).to(device))
            self.new_keys.append(new)
            self.unique_keys.append(unique)
        self.span = max(1, *(max(n) for n in self.new_keys))

    def batch(self, step: int) -> Batch:
        """Step ``step``'s batch ``(indices, offsets)``."""
        indices, offsets = self.base[step % _BATCHES]
        rank = self.ranks[step % _BATCHES]
        fresh = rank + (self.rows + step * self.span)
        return torch.where(rank >= 0, fresh, indices), offsets

    def asked(self, steps: int) -> int:
        """The new (key, table) pairs of steps ``0 .. steps - 1``."""
        return sum(sum(self.new_keys[s % _BATCHES]) for s in range(steps))


def step_pairs(w: Workload, device: torch.device, seed: int) -> list[Pairs]:
    """Per base batch of ``w`` (NONE pooling): its unique (key, table) pairs, by table, and
    each one's occurrences, ``(keys, tables, counts)``."""
    out = []
    for indices, _ in make_batches(w, _BATCHES, torch.device("cpu"), seed):
        keys, tables, counts = [], [], []
        for t, ids in enumerate(indices.view(w.tables, w.samples)):
            unique, occurrences = torch.unique(ids, return_counts=True)
            keys.append(unique)
            tables.append(torch.full_like(unique, t))
            counts.append(occurrences)
        out.append(tuple_of(torch.cat(keys), torch.cat(tables), torch.cat(counts), device))
    return out


def tuple_of(
    keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor, device: torch.device
) -> Pairs:
    return keys.to(device), tables.to(device), counts.to(device)


class _Sides:
    """The counter and the table, each call timed and its result checked."""

    def __init__(self, w: Workload, device: torch.device, config: KVCounter) -> None:
        self.device = device
        self.counter = MultiTableKVCounter([config] * w.tables, device)
        lfu = TableConfig(
            dim=1,
            max_capacity=config.slots,
            bucket_capacity=config.bucket_capacity,
            score_strategy=DynamicEmbScoreStrategy.LFU,
        )
        self.table = ScoredHashTable([lfu] * w.tables, device)
        self.times: dict[tuple[str, str], list[float]] = {}
        self.wrong: set[tuple[str, str]] = set()
        self.calls = 0

    def _call(
        self,
        side: str,
        regime: str,
        op: Callable[[], torch.Tensor],
        ok: Callable[[torch.Tensor], bool],
    ) -> None:
        out: list[torch.Tensor] = []
        self.times.setdefault((side, regime), []).append(
            seconds_of(lambda: out.append(op()), self.device)
        )
        self.calls += 1
        if not ok(out[0]):  # after the timer: one sync
            self.wrong.add((side, regime))

    def step(self, pairs: Pairs, counter_first: bool) -> None:
        """Both sides emptied, then each regime's call of each side."""
        keys, tables, counts = pairs
        self.counter.clear()
        self.table.clear()

        def add() -> torch.Tensor:
            return self.counter.add(keys, tables, counts)

        def insert() -> torch.Tensor:
            return self.table.find_or_insert(
                keys, tables, counts=counts, zero_new_rows=False
            ).status

        def counted(times: int) -> Callable[[torch.Tensor], bool]:
            return lambda got: torch.equal(got, times * counts)

        def all_of(status: InsertStatus) -> Callable[[torch.Tensor], bool]:
            return lambda got: bool((got == status).all())

        checks = {
            REGIMES[0]: {"counter": counted(1), "table": all_of(InsertStatus.INSERTED)},
            REGIMES[1]: {"counter": counted(2), "table": all_of(InsertStatus.HIT)},
        }
        ops = {"counter": add, "table": insert}
        order = _SIDES if counter_first else _SIDES[::-1]
        for regime in REGIMES:
            for side in order:
                self._call(side, regime, ops[side], checks[regime][side])


def counter_figures(
    w: Workload,
    device: torch.device,
    config: KVCounter,
    *,
    steps: int,
    rounds: int,
    warmup: int,
    seed: int,
    target: float,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The counter's add beside the table's find_or_insert, per regime: ``warmup`` untimed
    steps, then ``rounds`` rounds of ``steps`` (a round's figure: the median of its calls).

    Raises:
        AdmissionCheckError: a call whose result is not what its keys give, or a counter that
            evicted.
    """
    pairs = step_pairs(w, device, seed)
    sides = _Sides(w, device, config)
    rounds_s: dict[tuple[str, str], list[float]] = {}
    for i in range(warmup + rounds * steps):
        sides.step(pairs[i % _BATCHES], counter_first=i % 2 == 0)
        done = i + 1 - warmup
        if done == 0:
            sides.times.clear()
        elif done > 0 and done % steps == 0:
            for key, seconds in sides.times.items():
                rounds_s.setdefault(key, []).append(statistics.median(seconds))
            sides.times.clear()
    evicted = int(sides.counter.evicted_since_last_read().sum())
    if sides.wrong or evicted:
        raise AdmissionCheckError(
            f"counter figure: results other than the keys give in {sorted(sides.wrong)}; "
            f"{evicted} keys evicted by a counter that should stay under its capacity"
        )
    keys = statistics.fmean(int(p[0].numel()) for p in pairs)
    figures = []
    for regime in REGIMES:
        f = figure(
            f"counter add, {regime}",
            rounds_s["counter", regime],
            f"ScoredHashTable.find_or_insert of the same pairs, {regime} (LFU, same slots and "
            "bucket width, rows untouched)",
            rounds_s["table", regime],
            target,
            None,
            unit="s/call",
        )
        f["keys"] = keys
        f["keys_per_s"] = keys / f["median"]
        f["baseline_keys_per_s"] = keys / f["baseline"]["median"]
        f["throughput_ratio"] = f["keys_per_s"] / f["baseline_keys_per_s"]
        f["throughput_target"] = 1 / target
        figures.append(f)
    checks = {
        "calls_checked": sides.calls,
        "counter_evictions": evicted,
        "keys_per_call": keys,
        "slots_per_table": config.slots,
        "bucket_capacity": config.bucket_capacity,
    }
    return figures, checks


def print_report(report: dict[str, Any]) -> None:
    """The figures as a table, then the baselines and the checks."""
    w = report["workload"]
    print(
        f"admission bench on {report['device']} ({report['machine'].get('gpu', 'host')}): "
        f"{w['tables']} tables x {w['rows']:,} rows, D={w['dim']}, {w['optimizer']}; a step "
        f"looks up {w['samples']:,} ids a table, {w['unique_keys_per_table_step']:,.0f} unique, "
        f"{w['new_keys_per_table_step']:,.0f} new; median of {w['rounds']} alternating rounds "
        f"of {w['steps']} steps (min-max over rounds)"
    )
    head = ("figure", "median (min-max)", "baseline", "ratio", "target", "meets")
    rows = [head]
    for f in report["figures"]:
        met = "-" if f["meets_target"] is None else ("yes" if f["meets_target"] else "no")
        rows.append(
            (
                f["figure"],
                _spread(f),
                _spread(f["baseline"]),
                f"{f['ratio']:.3g}x",
                f"<= {f['target']:g}x",
                met,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        cells = [
            f"{c:<{widths[i]}}" if i in (0, 4) else f"{c:>{widths[i]}}" for i, c in enumerate(r)
        ]
        print("  " + "  ".join(cells).rstrip())
    print("  baselines:")
    for f in report["figures"]:
        print(f"    {f['figure']}: {f['baseline_name']}")
        if "note" in f:
            print(f"      {f['note']}")
        if "throughput_ratio" in f:
            print(
                f"      {f['keys']:,.0f} keys a call: {f['keys_per_s'] / 1e6:.3g} M keys/s beside "
                f"{f['baseline_keys_per_s'] / 1e6:.3g} M keys/s ({f['throughput_ratio']:.3g}x; "
                f"target >= {f['throughput_target']:.2g}x)"
            )
    a, c, s = (report["checks"][k] for k in ("admission", "counter", "score_function"))
    print(
        f"  admission counter: {w['counter_slots']:,} slots a table (the new keys of "
        f"{w['counter_steps']} steps); {a['admitted']:,} new keys admitted, {a['rejected']:,} "
        f"rejected (of {a['new_keys_asked']:,}), {a['counter_evictions']:,} counter evictions; "
        f"tables grew by {a['keys_added']['admission']:,} keys with admission, "
        f"{a['keys_added']['no admission']:,} without"
    )
    print(
        f"  counter figure: {c['calls_checked']:,} calls checked, {c['counter_evictions']} "
        "counter evictions (both sides under their capacity)"
    )
    evicted = {k: sum(v) for k, v in s["evicted_in_a_step"].items()}
    print(
        f"  score_function figure: {w['evicting_capacity']:,} slots a table; keys evicted "
        f"in one step after the rounds: {evicted}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _spread(stats: dict[str, Any]) -> str:
    """``median (min-max) ms``."""
    return f"{_ms(stats['median'])} ({_ms(stats['min'])}-{_ms(stats['max'])}) ms"
