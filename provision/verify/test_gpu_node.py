"""The fleet verification suite (testinfra). Against an inventory:
    pytest --hosts='ansible://gpu_nodes' --ansible-inventory=INVENTORY -p no:cacheprovider \\
        $(python3 -c 'import provision.verify, os; print(os.path.dirname(provision.verify.__file__))')/test_gpu_node.py
Each check is one test per host; a failure names the host and says what to do. The checks are the same ones
`gpuprov verify` runs on a single host (provision/verify/checks.py)."""
import warnings

import pytest

from provision.verify.checks import CHECKS, TestinfraHost

_ADAPTERS = {}


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_gpu_node(host, check):
    key = id(host)
    if key not in _ADAPTERS:
        _ADAPTERS[key] = TestinfraHost(host)
    res = check(_ADAPTERS[key])
    if res.status == "skip":
        pytest.skip(f"{res.name}: {res.detail}")
    if res.status == "warn":  # the node works; the risk is named (gpuprov verify exits 0 for it too)
        warnings.warn(f"{host.backend.get_hostname()}: {res.name}: {res.detail}", stacklevel=1)
        return
    assert res.status == "pass", f"{host.backend.get_hostname()}: {res.name}: {res.detail}"
