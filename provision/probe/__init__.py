"""Probes: facts that take running a binary (an engine's `--version`) and the on-disk cache that keeps them cheap.
The only layer besides the effects that runs programs or writes while gathering facts; `provision.facts` only
reads files under a root, and plans use facts alone (a plan writes nothing)."""
