"""GPU monitoring: NVML readings per GPU and per container, in Prometheus text format (`gpuprov metrics`)."""
