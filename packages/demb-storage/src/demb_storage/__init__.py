"""demb-storage: the scored hash table, score strategies, eviction, tiers and admission."""

__all__: list[str] = []
