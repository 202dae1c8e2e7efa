"""Kubernetes GPU nodes: GPU Feature Discovery labels (NFD local-source file, kubelet flag), RuntimeClass and the
NVIDIA device plugin's config from gpuprov's own settings, and the node set-up that ties them to the engine."""
