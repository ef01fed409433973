"""Models. Each model folder holds the single-device model and, beside it, how to parallelize it."""
