"""demb-optim: one spec per optimizer (state width, hyper-parameters, fused update)."""

__all__: list[str] = []
