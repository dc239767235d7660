"""demb-io: the on-disk checkpoint and delta formats and their offline tools (no torch import)."""

__all__: list[str] = []
