"""Packing: algorithms on conversation lengths and the pack pipeline (tokenize, pack, write, report)."""
