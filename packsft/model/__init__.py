"""Megatron-Core GPT construction for packsft: config, attention backends, hidden-state output head."""
