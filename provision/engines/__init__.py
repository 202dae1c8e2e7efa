"""Engine configuration: merge our runtime into each engine's own config, never overwrite it."""
