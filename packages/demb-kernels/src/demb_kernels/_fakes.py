"""Fake (meta) kernels of the table, optimizer and row-initializer ops, for tracing and
torch.compile."""

from __future__ import annotations

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)

__all__: list[str] = []


def _fake_insert(
    keys: torch.Tensor, words: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = keys.shape[0]
    return (
        keys.new_empty((n,)),
        keys.new_empty((n,)),
        keys.new_empty((n,)),
        keys.new_empty((words, n)),
    )


@torch.library.register_fake("demb::table_lookup")  # type: ignore[untyped-decorator]
def _lookup_fake(*args: torch.Tensor | None) -> torch.Tensor:
    keys = args[6]
    assert keys is not None
    return keys.new_empty(keys.shape)


@torch.library.register_fake("demb::table_find_rows")  # type: ignore[untyped-decorator]
def _find_rows_fake(
    *args: torch.Tensor | list[torch.Tensor] | int,
) -> tuple[torch.Tensor, torch.Tensor]:
    keys, dim = args[7], args[9]
    assert isinstance(keys, torch.Tensor)
    assert isinstance(dim, int)
    return keys.new_empty((keys.shape[0], dim), dtype=torch.float32), keys.new_empty(keys.shape)


@torch.library.register_fake("demb::table_find_batch_rows")  # type: ignore[untyped-decorator]
def _find_batch_rows_fake(
    *args: torch.Tensor | list[torch.Tensor] | int,
) -> tuple[torch.Tensor, torch.Tensor]:
    indices, dim = args[7], args[11]
    assert isinstance(indices, torch.Tensor)
    assert isinstance(dim, int)
    n = indices.shape[0]
    return indices.new_empty((n, dim), dtype=torch.float32), indices.new_empty((n,))


@torch.library.register_fake("demb::table_find_or_insert")  # type: ignore[untyped-decorator]
def _find_or_insert_fake(
    *args: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    scores, keys = args[2], args[7]
    assert scores is not None
    assert keys is not None
    all_hit = torch.empty((), dtype=torch.bool)  # a host flag
    return (*_fake_insert(keys, scores.shape[0]), all_hit)


@torch.library.register_fake("demb::table_find_or_insert_rows")  # type: ignore[untyped-decorator]
def _find_or_insert_rows_fake(
    *args: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    scores, keys, dim = args[2], args[7], args[13]
    assert isinstance(scores, torch.Tensor)
    assert isinstance(keys, torch.Tensor)
    assert isinstance(dim, int)
    all_hit = torch.empty((), dtype=torch.bool)  # a host flag
    # (N_occ, dim) when every key was found, else (0, dim): a size known only from the data.
    occurrences = torch.library.get_ctx().new_dynamic_size()
    rows = keys.new_empty((occurrences, dim), dtype=torch.float32)
    return (*_fake_insert(keys, scores.shape[0]), all_hit, rows)


@torch.library.register_fake("demb::table_insert_or_assign")  # type: ignore[untyped-decorator]
def _insert_or_assign_fake(
    *args: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fake_insert(args[7], args[2].shape[0])


@torch.library.register_fake("demb::table_erase")  # type: ignore[untyped-decorator]
def _erase_fake(*args: torch.Tensor) -> torch.Tensor:
    return args[7].new_empty(args[7].shape)


@torch.library.register_fake("demb::table_timestamp")  # type: ignore[untyped-decorator]
def _timestamp_fake(like: torch.Tensor, count: int = 1) -> torch.Tensor:
    return like.new_empty((count,), dtype=torch.int64)


@torch.library.register_fake("demb::optimizer_update")  # type: ignore[untyped-decorator]
def _optimizer_update_fake(*args: object) -> None:
    return None


@torch.library.register_fake("demb::init_rows")  # type: ignore[untyped-decorator]
def _init_rows_fake(*args: object) -> None:
    return None


@torch.library.register_fake("demb::init_new_rows")  # type: ignore[untyped-decorator]
def _init_new_rows_fake(*args: object) -> None:
    return None
