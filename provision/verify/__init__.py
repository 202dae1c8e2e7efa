"""Verification: layered checks from PCI device to a GPU container, for one host (`gpuprov verify`) or a fleet
(the testinfra suite test_gpu_node.py over an Ansible inventory). The checks exist once, in checks.py."""
