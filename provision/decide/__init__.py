"""Decisions: pure functions from facts and options to what should be done. No I/O beyond reading vendored data."""
