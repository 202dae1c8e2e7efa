"""gpuprov: turn a Linux host into a GPU container node, and a fleet the same way."""

__version__ = "0.1.0"
