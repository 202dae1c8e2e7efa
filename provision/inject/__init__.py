"""The injection runtime, split like NVIDIA's toolkit: discover (plain data) -> edits (pure) -> modify (create only).
Nothing here imports more than the standard library's basics: it runs on every container start."""
