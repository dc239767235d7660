"""The robustness tests' fuzzing at a larger count (offline): ``N`` single mutations of a small
checkpoint and of a small delta, each read back; prints how many ended in a FormatError and how
many read (harmless meta edits). Any other exception stops it.

Usage: ``python fuzz_offline.py 100000``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_checkpoint_robustness as fuzzing


def main() -> None:
    fuzzing.MUTATIONS = int(sys.argv[1])
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        fuzzing.small_checkpoint(root / "c")
        counts = fuzzing.fuzz(root / "c", fuzzing.read_all, 12345)
        print(f"checkpoints: {fuzzing.MUTATIONS} mutations: {counts}")
        fuzzing.small_delta(root / "d")
        counts = fuzzing.fuzz(root / "d", fuzzing.read_delta_error, 54321)
        print(f"deltas: {fuzzing.MUTATIONS} mutations: {counts}")


if __name__ == "__main__":
    main()
