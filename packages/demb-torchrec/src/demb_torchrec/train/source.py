"""Where ``demb train`` takes its samples: the built-in synthetic click stream, or a Criteo TSV /
Parquet file whose last ``eval_fraction`` of samples is held out for evaluation. Both give the
global batch of a step (every rank takes its own slice of it) and the held-out set."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from demb_torchrec.errors import ConfigError
from demb_torchrec.train.batch import ClickBatch
from demb_torchrec.train.config import Settings
from demb_torchrec.train.criteo import ClickFile
from demb_torchrec.train.synthetic import SyntheticClicks

__all__ = ["Source", "make_source"]


class Source:
    """The samples of a run: :meth:`train_batch` of a step, :meth:`eval_set` at a step."""

    def __init__(self, settings: Settings) -> None:
        data = settings["data"]
        self.batch_size = int(data["batch_size"])
        self.eval_samples = int(data["eval_samples"])
        self.path = str(data["path"])
        self._synthetic: SyntheticClicks | None = None
        self._file: ClickFile | None = None
        self._iter: Iterator[ClickBatch] | None = None
        self._next_step = 0
        self._eval: ClickBatch | None = None
        if not self.path:
            self._synthetic = SyntheticClicks(
                seed=int(data["seed"]), scale=float(data["scale"]), drift=float(data["drift"])
            )
            self.train_samples: int | None = None
        else:
            if not Path(self.path).is_file():
                raise ConfigError(f"data.path={self.path!r}: no such file")
            self._file = ClickFile(Path(self.path))
            total = self._file.num_samples
            held = max(1, round(total * float(data["eval_fraction"])))
            self.train_samples = total - held
            if self.train_samples < self.batch_size:
                raise ConfigError(
                    f"data.path={self.path!r}: {total} samples, too few for one batch of "
                    f"{self.batch_size} besides the held-out {held}"
                )

    @property
    def steps_available(self) -> int | None:
        """Whole batches the data holds (None: unbounded)."""
        return None if self.train_samples is None else self.train_samples // self.batch_size

    def train_batch(self, step: int) -> ClickBatch:
        """The global batch of ``step`` (steps are asked for in order, from any start)."""
        if self._synthetic is not None:
            return self._synthetic.batch(step, self.batch_size)
        assert self._file is not None
        assert self.train_samples is not None
        if self._iter is None or step != self._next_step:
            start = step * self.batch_size
            self._iter = self._file.batches(self.batch_size, start=start, stop=self.train_samples)
        self._next_step = step + 1
        try:
            return next(self._iter)
        except StopIteration:
            raise ConfigError(
                f"data.path={self.path!r}: step {step} is past the data's "
                f"{self.steps_available} batches"
            ) from None

    def eval_set(self, step: int) -> ClickBatch:
        """The held-out samples to evaluate at ``step``: the synthetic stream's samples of that
        moment, or the file's held-out tail (its first ``eval_samples``)."""
        if self._synthetic is not None:
            return self._synthetic.eval_batch(step, self.eval_samples)
        if self._eval is None:
            assert self._file is not None
            assert self.train_samples is not None
            stop = min(self._file.num_samples, self.train_samples + self.eval_samples)
            parts = list(self._file.batches(stop - self.train_samples, self.train_samples, stop))
            self._eval = parts[0]
        return self._eval


def make_source(settings: Settings) -> Source:
    """The run's samples (checks the data file now)."""
    return Source(settings)
