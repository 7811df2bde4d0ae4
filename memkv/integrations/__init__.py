"""Bridges between memkv and inference engines (transformers)."""
