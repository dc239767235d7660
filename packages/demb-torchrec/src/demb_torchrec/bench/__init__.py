"""Benchmarks run by the ``demb bench`` command."""

__all__: list[str] = []
