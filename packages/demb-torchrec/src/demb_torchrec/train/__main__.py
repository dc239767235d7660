"""``python -m demb_torchrec.train [serve] ...``: ``demb train`` (or ``demb serve``)."""

from __future__ import annotations

import sys

from demb_torchrec.train.cli import main_serve, main_train

__all__ = ["main"]


def main() -> int:
    """``python -m demb_torchrec.train [train|serve] ...``: returns the exit status."""
    argv = sys.argv[1:]
    if argv and argv[0] == "serve":
        return main_serve(argv[1:])
    if argv and argv[0] == "train":
        argv = argv[1:]
    return main_train(argv)


if __name__ == "__main__":
    raise SystemExit(main())
