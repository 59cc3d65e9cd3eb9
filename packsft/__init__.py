"""packsft: offline-packed SFT for Megatron-Core."""
