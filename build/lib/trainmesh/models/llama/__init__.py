"""Llama-style decoder: ``model`` (mesh-free), ``presets`` (shapes, no torch)."""
