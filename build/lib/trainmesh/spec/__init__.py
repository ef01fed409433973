"""The job spec: plain pydantic data (no torch, no ray), a leaf every layer may import."""
