"""provision/values.py, the one table of value rules: each rule on values it must take and values it must refuse, and
the file stays loadable where gpuprov is not installed (the role's module_utils link)."""
from __future__ import annotations

import ast
import os

import pytest

from provision import values
from tests.conftest import REPO

CASES = {
    "url": (["https://m.example/docker-ce/linux", "http://10.0.0.1:8080/x?y=1", "http://[fd00::1]/d",
             "file:///srv/cuda"],
            ["https://m.example/d\n[trusted=yes] http://e", "ftp://m.example/d", "https://m.example/a b", "http://",
             "file://host/x", "https://m.example:99999/", "https://m.example/\x7f", "docker-ce", "", None, 5]),
    "kernel_release": (["6.1.0-28-amd64", "5.14.0-427.13.1.el9_4.x86_64", "6.8.0+", "4.18.0~rc1"],
                       ["../../etc", "6.1/..", "a..b", "-6.1", "6.1.0\n", "x" * 65, "6.1.0 amd64", ""]),
    "runtime_name": (["nvidia", "nvidia-gpu", "Nvidia_2"], ["a.b", "../x", 'n"x', "-n", "n" * 64, ""]),
    "cri_handler": (["nvidia", "nvidia-2"], ["Nvidia", "nvidia_2", "-nvidia", "nvidia-", ""]),
    "driver": (["auto", "skip", "535", "1"], ["５３５", "535; reboot", "latest", "53500", ""]),
    "path": (["/etc/docker/daemon.json", "rel/dir", "/a b"], ["/a\nb", "/a\x00", "/" + "a" * 4097, ""]),
    "abs_path": (["/usr/local/bin/gpuprov-runtime", "/", "/usr/lib/x.so.1"],
                 ["rel", "/a/../b", "/a\tb", '/a"b', "/a'b", "/a\\b", "/" + "é" * 2049, ""]),
    "abs_paths": (["/etc/cdi:/var/run/cdi", "/etc/cdi:", "/etc/cdi"], ["/etc/cdi:rel", "/etc/cdi:/a/../b", ""]),
    "namespace": (["nvidia-device-plugin", "kube-system", "a"], ["Kube", "a_b", "-a", "a-", "a" * 64, ""]),
    "pci_id": (["10de:2330", "10DE:2330:10de:16c1"], ["10de:233", "10de:2330\n", "10de:2330:10de", "xyz", "",
                                                      "8086:1234", "1002:73bf:10de:16c1"]),  # another vendor's
    "gpg_key": (["0xABCDEF", "ops <ops@example.com>"], ["--homedir=/tmp", "k\n", ""]),
    "listen": (["127.0.0.1:9400", "[::1]:9400", "localhost:1", "[fe80::1%eth0]:9400"],
               ["::1:9400", "host:0", "host:65536", "host", ":9400", "ho st:1", "[::1]"]),
    "packages": (["docker-ce,containerd.io", "nvidia-driver-535", "libnvidia-gl-535:i386", "g++"],
                 ["docker-ce,--allow-unauthenticated", "a b", "-y", "x\n"]),
    "package": (["docker.io", "nvidia-driver-535", "libnvidia-gl-535:i386", "g++"],
                ["-y", "--allow-remove-essential", "a b", "docker.io,x", "x\n", "", 7, ["docker.io"]]),
    "boolean": ([True, False], ["false", 0, 1, None]),
    "engine_option": (['log-driver="local"', "max-concurrent-downloads=4", 'log-opts={"max-size":"10m"}',
                       "live-restore=true"],
                      ['runtimes={}', 'default-runtime="runc"', "features={}", "log-driver=local", 'Log-driver="x"',
                       "=1", "log-driver", "log-driver=", 'a b="x"', "x=" + "1" * 4100, ""]),
    "user_name": (["alice", "_svc", "ci-runner2"], ["Alice", "-x", "a:b", "root\n", "a" * 33, "", "a b"]),
}


@pytest.mark.parametrize("rule", sorted(values.RULES))
def test_each_rule_takes_and_refuses(rule):
    good, bad = CASES[rule]
    for v in good:
        assert values.RULES[rule](v) == v, (rule, v)
    for v in bad:
        with pytest.raises(values.BadValue) as exc:
            values.RULES[rule](v)
        assert repr(v) in str(exc.value) and exc.value.rule in str(exc.value), (rule, v)


def test_check_walks_lists_dicts_and_paths():
    from pathlib import Path

    assert values.check("kernel_release", None) is None
    assert values.check("kernel_release", ["6.1.0-28-amd64"]) == ["6.1.0-28-amd64"]
    assert values.check("path", Path("/srv/b")) == Path("/srv/b")
    with pytest.raises(values.BadValue):
        values.check("url", {"cuda": "https://ok.example", "epel": "ftp://no.example"})
    assert values.listen_address("[::1]:9400") == ("::1", 9400)


def test_values_py_imports_nothing_the_node_lacks():
    """The role's module loads it through module_utils with the node's own Python: standard library only."""
    tree = ast.parse((REPO / "provision/values.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "re", "json", "urllib.parse"}, imported
    link = REPO / "roles/gpuprov/module_utils/gpuprov_values.py"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.resolve() == (REPO / "provision/values.py").resolve()
