"""Mixture-of-Experts blocks (used by the Llama family's ``model.moe``)."""
