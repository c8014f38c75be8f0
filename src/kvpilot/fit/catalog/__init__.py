"""Real Hugging Face `config.json` contents of popular models, one module per family.

Each module exposes `CONFIGS: dict[str, CatalogEntry]` keyed by the canonical short name.
"""
