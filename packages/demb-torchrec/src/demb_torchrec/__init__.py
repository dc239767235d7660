"""demb-torchrec: dynamic embedding tables in TorchRec (table module, sharding, model APIs)."""

__all__: list[str] = []
