"""The built-in click stream of ``demb train``: deterministic synthetic data of Criteo's shape.

:class:`SyntheticClicks` behaves like a real click log where it matters to dynamic embeddings:

* **Power-law popularity.** Each categorical feature ``f`` has a vocabulary of ``V_f`` items;
  a sample draws a popularity rank ``r`` in ``[0, V_f)`` from the truncated continuous power law
  ``P(r) ∝ (r + 1) ** -zipf_exponent`` (the inverse CDF of a Pareto density on ``[1, V_f + 1)``,
  floored), so a few items carry most occurrences.
* **Vocabularies like Criteo's.** :data:`BASE_VOCAB_SIZES` follows the Kaggle set's cardinalities
  with the eight huge features (10^5 to 10^7 ids) capped to 3·10^4 - 1.2·10^5: a few features
  of 3-30 ids, several of hundreds to thousands, eight large. ``scale`` multiplies every base
  size of at least :data:`SCALED_MIN_VOCAB` (the tiny features stay as they are).
* **Drift.** The large features (:data:`DRIFTING_FEATURES`) see new items arrive: at ``step``,
  rank ``r`` is item ``n = floor(step * drift) - r``, so the newest item is the most popular and
  an item fades as it ages (its rank grows by ``drift`` per step). Other features use ``n = r``.
* **Hashed ids.** The id of ``(f, n)`` is ``splitmix64(key_f + n * 0x9E3779B97F4A7C15)`` with the
  top bit cleared, ``key_f`` a hash of ``(seed, f)``: sparse, unbounded, non-negative ``int64``.
* **A hidden ground-truth model.** ``logit = bias + signal * (sum_f s_f w(f, id) +
  sum_{f<g} <t_f u(f, id_f), t_g u(g, id_g)> + sum_j v_j dense_j)``: ``w`` (~N(0, 1)) and the
  4-d latent ``u`` are hashes of the id, so nothing is stored for the unbounded vocabulary;
  ``s_f``, ``t_f``, ``v_j`` and the dense features' law are fixed by the seed; ``bias`` is solved
  at construction so the click rate is ``click_rate``. ``label ~ Bernoulli(sigmoid(logit))``,
  and :meth:`SyntheticClicks.oracle_logits` gives the exact logit of any batch of the stream:
  its AUC is the stream's Bayes-optimal AUC (0.79-0.84 with the defaults, by seed).
* **Dense features.** ``dense_j = log1p(floor(exp(mu_j + sigma_j z)))``, ``z ~ N(0, 1)``,
  ``mu_j``, ``sigma_j`` fixed by the seed; missing (0) at Criteo-like rates (0-77 %).

Defaults: ``seed=0, scale=1.0, drift=0.5`` (items per step: over ``T`` steps each drifting
feature gains ``T / 2`` new items), ``zipf_exponent=1.1, click_rate=0.25, signal=1.0``. A batch of
4096 samples takes about 3.5 ms on one core; construction (solving the bias) about 70 ms.

A batch is a pure function of ``(seed, step, batch_size)`` and of the parameters: its random
draws come from ``SeedSequence([seed, stream, step])`` (stream 0 train, 1 eval, 2 calibration),
so a resumed run and every rank of a multi-rank run see the same samples in any call order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from demb_torchrec.errors import ConfigError, InputError
from demb_torchrec.train.batch import ID_MASK, NUM_DENSE, NUM_SPARSE, ClickBatch, splitmix64

__all__ = [
    "BASE_VOCAB_SIZES",
    "DRIFTING_FEATURES",
    "SCALED_MIN_VOCAB",
    "SyntheticClicks",
]

BASE_VOCAB_SIZES: tuple[int, ...] = (
    1460, 583, 120_000, 70_000, 305, 24, 12_517, 633, 3, 30_000, 5683, 100_000, 3194,
    27, 14_992, 80_000, 10, 5652, 2173, 4, 90_000, 18, 15, 50_000, 105, 40_000,
)  # fmt: skip
"""Items per categorical feature at ``scale=1.0`` (about 0.63 M in all)."""

SCALED_MIN_VOCAB = 1000
"""Base sizes from this one up are multiplied by ``scale``; smaller ones never change."""

DRIFTING_FEATURES: tuple[int, ...] = tuple(f for f, v in enumerate(BASE_VOCAB_SIZES) if v >= 30_000)
"""The large features, whose popular items shift with the step: 2, 3, 9, 11, 15, 20, 23, 25."""

_DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22)
"""Share of missing values per dense feature (close to Criteo Kaggle's)."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_LATENT = 4  # dimensions of the hidden pairwise-interaction latents
_LATENT_UNIT = 3.0 / 2.0**30  # an int16 field (~uniform) has variance 2**30 / 3
_LOW_FIELDS = np.uint64(0x0000FFFF0000FFFF)
_STREAM_TRAIN, _STREAM_EVAL, _STREAM_CALIBRATION = 0, 1, 2
_CALIBRATION_CHUNKS, _CALIBRATION_SAMPLES, _CALIBRATION_STEP = 32, 1024, 1000


def _finite(name: str, value: float, low: float, high: float, *, open_low: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name}: must be a number, got {value!r}")
    x = float(value)
    ok = math.isfinite(x) and (x > low if open_low else x >= low) and x < high
    if not ok:
        bound = f"{'>' if open_low else '>='} {low}" + (f" and < {high}" if high < math.inf else "")
        raise ConfigError(f"{name}: must be finite and {bound}, got {value!r}")
    return x


def _non_negative_int(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(f"{name}: must be an int >= {minimum}, got {value!r}")
    return int(value)


class SyntheticClicks:
    """A deterministic, random-access synthetic click stream (see the module docstring).

    Args:
        seed: fixes the ids, the ground-truth model and every batch; an int ``>= 0``.
        scale: multiplies the vocabulary of every feature of base size ``>= 1000``; ``> 0``.
        drift: items per step by which the popular set of each drifting feature moves; ``>= 0``
            (0: a stationary stream).
        zipf_exponent: the power-law exponent of item popularity; ``> 0`` (1.05-1.2 is typical).
        click_rate: the mean label the bias is solved for; in ``(0, 1)``.
        signal: multiplies every term of the hidden logit but the bias (1.0: Bayes AUC ~0.8).
        vocab_sizes: 26 vocabulary sizes ``>= 1`` that replace ``BASE_VOCAB_SIZES`` scaled.

    Raises:
        ConfigError: a parameter out of range; the message names it.

    Example::

        stream = SyntheticClicks(seed=0)
        batch = stream.batch(step=7, batch_size=4096)  # the same batch on every call
        auc_logits = stream.oracle_logits(batch)       # (4096,) float32
    """

    def __init__(
        self,
        seed: int = 0,
        scale: float = 1.0,
        drift: float = 0.5,
        zipf_exponent: float = 1.1,
        click_rate: float = 0.25,
        signal: float = 1.0,
        vocab_sizes: Sequence[int] | None = None,
    ) -> None:
        self.seed = _non_negative_int("seed", seed)
        if self.seed >= 2**64:
            raise ConfigError(f"seed: must be below 2**64, got {seed!r}")
        self.scale = _finite("scale", scale, 0.0, math.inf, open_low=True)
        self.drift = _finite("drift", drift, 0.0, math.inf, open_low=False)
        self.zipf_exponent = _finite("zipf_exponent", zipf_exponent, 0.0, 16.0, open_low=True)
        self.click_rate = _finite("click_rate", click_rate, 0.0, 1.0, open_low=True)
        self.signal = _finite("signal", signal, 0.0, math.inf, open_low=False)
        if vocab_sizes is None:
            sizes = tuple(
                max(1, round(v * self.scale)) if v >= SCALED_MIN_VOCAB else v
                for v in BASE_VOCAB_SIZES
            )
        else:
            sizes = tuple(vocab_sizes)
            if len(sizes) != NUM_SPARSE:
                raise ConfigError(f"vocab_sizes: must hold {NUM_SPARSE} sizes, got {len(sizes)}")
            for f, v in enumerate(sizes):
                _non_negative_int(f"vocab_sizes[{f}]", v, 1)
        self.vocab_sizes: tuple[int, ...] = tuple(int(v) for v in sizes)

        params = np.random.default_rng(np.random.SeedSequence([self.seed, 0xC11C5]))
        feats = np.arange(NUM_SPARSE, dtype=np.uint64)[:, None]
        seed_bits = splitmix64(np.full((1, 1), self.seed, dtype=np.uint64) + _GOLDEN)
        with np.errstate(over="ignore"):
            self._key = splitmix64(seed_bits ^ ((feats + np.uint64(1)) * _GOLDEN))
            self._weight_salt = splitmix64(self._key + np.uint64(1))
            self._latent_salt = splitmix64(self._key + np.uint64(2))
        self._vocab = np.asarray(self.vocab_sizes, dtype=np.float64)[:, None]
        self._drifting = np.zeros((NUM_SPARSE, 1), dtype=bool)
        self._drifting[list(DRIFTING_FEATURES)] = True
        # ground-truth model: per-feature strengths of the linear and the pairwise terms
        self._w_scale = params.uniform(0.1, 0.35, size=(NUM_SPARSE, 1)).astype(np.float32)
        self._t_scale = params.uniform(0.05, 0.15, size=(NUM_SPARSE, 1, 1)).astype(np.float32)
        # dense features: raw count floor(exp(mu + sigma * z)), missing at Criteo-like rates
        self._mu = params.uniform(0.0, 3.0, size=NUM_DENSE)
        self._sigma = params.uniform(0.5, 1.5, size=NUM_DENSE)
        self._missing = np.asarray(_DENSE_MISSING)
        self._v = params.normal(0.0, 0.2, size=NUM_DENSE)
        self.bias = 0.0
        self.bias = self._solve_bias()

    def item_offset(self, step: int) -> int:
        """The item at popularity rank 0 of every drifting feature at ``step``."""
        return math.floor(_non_negative_int("step", step) * self.drift)

    def batch(self, step: int, batch_size: int) -> ClickBatch:
        """The training batch of ``step``: ``batch_size`` samples, the same on every call.

        Args:
            step: the training step, ``>= 0``; it fixes the RNG stream and the drift.
            batch_size: samples, ``>= 1``.

        Returns:
            A :class:`ClickBatch`: dense ``(B, 13)`` float32, sparse ``(B, 26)`` int64,
            labels ``(B,)`` float32.
        """
        return self._sample(_STREAM_TRAIN, step, batch_size)

    def eval_batch(self, step: int, batch_size: int) -> ClickBatch:
        """Held-out samples from the distribution at ``step`` (an RNG stream no training batch
        uses); same shapes as :meth:`batch`."""
        return self._sample(_STREAM_EVAL, step, batch_size)

    def oracle_logits(self, batch: ClickBatch) -> torch.Tensor:
        """The hidden model's logit of each sample of ``batch`` (a batch of this stream).

        ``P(label = 1) = sigmoid(logit)`` exactly, so the AUC of these logits against the labels
        is the Bayes-optimal AUC of the stream (up to sampling noise).

        Returns:
            ``(B,)`` float32.
        """
        sparse = np.ascontiguousarray(batch.sparse.detach().cpu().numpy().T).view(np.uint64)
        dense = batch.dense.detach().cpu().numpy()
        return torch.from_numpy(self._logits(sparse, dense).astype(np.float32))

    def _sample(self, stream: int, step: int, batch_size: int) -> ClickBatch:
        offset = self.item_offset(step)
        b = _non_negative_int("batch_size", batch_size, 1)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, stream, step]))
        ids = self._ids(rng.random((NUM_SPARSE, b)), offset)
        z = rng.standard_normal((b, NUM_DENSE))
        present = rng.random((b, NUM_DENSE)) >= self._missing
        counts = np.floor(np.exp(self._mu + self._sigma * z))
        dense = np.where(present, np.log1p(counts), 0.0).astype(np.float32)
        logits = self._logits(ids, dense)
        labels = (rng.random(b) * (1.0 + np.exp(-logits)) < 1.0).astype(np.float32)
        sparse = np.ascontiguousarray(ids.T).view(np.int64)
        return ClickBatch.from_numpy(dense, sparse, labels)

    def _ids(self, u: npt.NDArray[np.float64], offset: int) -> npt.NDArray[np.uint64]:
        """Ids ``(26, B)`` uint64 of the uniforms ``u`` ``(26, B)``: rank, item, hash."""
        a = self.zipf_exponent
        if abs(a - 1.0) < 1e-9:
            x = np.exp(u * np.log1p(self._vocab))
        else:
            c = np.expm1((1.0 - a) * np.log1p(self._vocab))  # (V + 1) ** (1 - a) - 1
            x = np.exp(np.log1p(u * c) / (1.0 - a))
        rank = np.minimum(x.astype(np.int64) - 1, self._vocab.astype(np.int64) - 1)
        np.maximum(rank, 0, out=rank)
        items = np.where(self._drifting, offset - rank, rank)
        with np.errstate(over="ignore"):
            bits = self._key + items.view(np.uint64) * _GOLDEN
        return splitmix64(bits) & np.uint64(ID_MASK)

    def _logits(
        self, ids: npt.NDArray[np.uint64], dense: npt.NDArray[np.float32]
    ) -> npt.NDArray[np.float64]:
        """The hidden logit ``(B,)`` float64 of ids ``(26, B)`` uint64 and dense ``(B, 13)``."""
        if ids.shape[0] != NUM_SPARSE or dense.shape != (ids.shape[1], NUM_DENSE):
            raise InputError("batch", f"ids {ids.shape} and dense {dense.shape} do not agree")
        b = ids.shape[1]
        # w ~ N(0, 1): the Irwin-Hall sum of the four 16-bit fields of a hash, centred, scaled
        hw = splitmix64(ids ^ self._weight_salt)
        pairs = (hw & _LOW_FIELDS) + ((hw >> np.uint64(16)) & _LOW_FIELDS)
        fields = ((pairs & np.uint64(0xFFFFFFFF)) + (pairs >> np.uint64(32))).astype(np.float32)
        w = fields * np.float32(math.sqrt(3.0) / 65536.0) - np.float32(2.0 * math.sqrt(3.0))
        linear = (self._w_scale * w).sum(axis=0, dtype=np.float64)
        # latents: a hash's four 16-bit fields as int16 (~uniform), times t_f: (26, B, 4)
        hl = splitmix64(ids ^ self._latent_salt).view(np.int16).reshape(NUM_SPARSE, b, _LATENT)
        lat = hl.astype(np.float32) * self._t_scale
        total = lat.sum(axis=0)
        lat *= lat
        pairwise = (total * total - lat.sum(axis=0)).sum(axis=-1, dtype=np.float64)
        pairwise *= 0.5 * _LATENT_UNIT
        dense_term = dense.astype(np.float64) @ self._v
        out: npt.NDArray[np.float64] = self.bias + self.signal * (linear + pairwise + dense_term)
        return out

    def _solve_bias(self) -> float:
        """The bias whose mean click probability on calibration samples is ``click_rate``."""
        # the head items of drifting features move the click rate a little over time:
        # calibrate on samples spread over many steps
        chunks = [
            self._sample(_STREAM_CALIBRATION, k * _CALIBRATION_STEP, _CALIBRATION_SAMPLES)
            for k in range(_CALIBRATION_CHUNKS)
        ]
        logits = self.oracle_logits(ClickBatch.concat(chunks)).double().numpy() - self.bias
        lo, hi = -40.0, 40.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < self.click_rate:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)
