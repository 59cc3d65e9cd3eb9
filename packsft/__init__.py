"""packsft: offline-packed SFT for Megatron-Core."""

__version__ = "0.1.0"
