"""GPU sharing with limits on open mechanisms: NVIDIA MPS, per-container memory caps and compute shares."""
