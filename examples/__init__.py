"""Examples that live next to the repository, not in the wheel (importable from a checkout)."""
