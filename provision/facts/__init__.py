"""Facts: read-only probes of a host, all through a root path so fixture trees work."""
