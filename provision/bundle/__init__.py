"""Offline bundles: build once where the package archives are reachable, install with the network off."""
