"""Packed rows as tensors: dataset, collate, samplers, loader, context-parallel slicing."""
