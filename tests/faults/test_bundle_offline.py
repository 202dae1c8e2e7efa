"""install-offline.sh checks a bundle with the host's own sha256sum and gpgv before it runs anything from it, in a
fresh Debian 12 host with the network off. Every tampered bundle here carries a booby-trapped `gpuprov` (a wheel
of the same name and version whose command only writes a marker file); a refusal must exit 8 with its one-line
reason and leave the host as it was: no marker, no /opt/gpuprov, no /var/lib/gpuprov, no package installed.
A last control run shows the trap is armed: the same kind of bundle, accepted as unsigned when no keyring is
given and its manifest names no key, does run it. The big bundle is the session's real Debian 12 bundle (built
once, shared with tests/integration/test_bundle_e2e.py)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.bundles import link_copy, make_signer, rewrite_sums, small_bundle, trap_wheel
from tests.conftest import needs
from tests.integration.hosts import Host

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", "gpg", "gpgv", docker=True)]
MARKER = "/tmp/gpuprov-trap-ran"


@dataclass
class Case:
    args: str
    why: str


def arm(bundle: Path) -> None:
    """Every wheel named gpuprov-* replaced by the trap (new files: the copy's links to the original are cut)."""
    for whl in (bundle / "wheels").glob("gpuprov-*.whl"):
        trap = trap_wheel(whl, MARKER)
        whl.unlink()
        whl.write_bytes(trap)


def small(base: Path, name: str) -> Path:
    b = small_bundle(base / name)
    (b / "wheels/gpuprov-0-py3-none-any.whl").rename(b / "wheels/gpuprov-0.1.0-py3-none-any.whl")
    arm(b)
    rewrite_sums(b)
    return b


def add_line(bundle: Path, line: str) -> None:
    with open(bundle / "SHA256SUMS", "a") as fh:
        fh.write(line + "\n")


@pytest.fixture(scope="module")
def cases(tmp_path_factory, debian12_bundle):
    base = tmp_path_factory.mktemp("hostile")
    signer = make_signer(tmp_path_factory.mktemp("signer"))
    attacker = make_signer(tmp_path_factory.mktemp("attacker"), "attacker@gpuprov.invalid")
    keys = tmp_path_factory.mktemp("keys")
    shutil.copy(signer.keyring, keys / "signer.gpg")
    kr = "--keyring /keys/signer.gpg"
    out: dict[str, Case] = {}

    # The reported attack on the real bundle: gpuprov swapped, checksums regenerated, signature deleted.
    b = link_copy(debian12_bundle, base / "real-keyring-sig-deleted")
    signer.sign(b)
    arm(b)
    rewrite_sums(b, drop_keys=True)
    (b / "SHA256SUMS.sig").unlink()
    out[b.name] = Case(kr, "SHA256SUMS.sig is missing but the bundle must be signed (--keyring was given)")

    b = link_copy(debian12_bundle, base / "real-manifest-signed-sig-deleted")
    signer.sign(b)
    arm(b)
    rewrite_sums(b)  # the manifest still names the signing key
    (b / "SHA256SUMS.sig").unlink()
    out[b.name] = Case("", "its manifest names signing keys")

    b = link_copy(debian12_bundle, base / "real-resigned-by-attacker")
    signer.sign(b)
    arm(b)
    rewrite_sums(b)
    attacker.sign(b)
    out[b.name] = Case(kr, "the signature of SHA256SUMS does not verify against /keys/signer.gpg")

    b = small(base, "sig-garbage")
    signer.sign(b)
    (b / "SHA256SUMS.sig").write_bytes(os.urandom(300))
    out[b.name] = Case(kr, "does not verify")

    b = small(base, "sums-traversal")
    add_line(b, f"{'a' * 64}  ../../../etc/passwd")
    out[b.name] = Case("", "a path leading out of the bundle")

    b = small(base, "sums-traversal-inner")
    add_line(b, f"{'a' * 64}  repo/../../outside")
    out[b.name] = Case("", "a path leading out of the bundle")

    b = small(base, "sums-absolute")
    add_line(b, f"{'a' * 64}  /etc/hostname")
    out[b.name] = Case("", "is not `<sha256>  <plain relative path>`")

    b = small(base, "sums-duplicate")
    add_line(b, next(ln for ln in (b / "SHA256SUMS").read_text().splitlines() if "wheels/" in ln))
    out[b.name] = Case("", "SHA256SUMS lists wheels/gpuprov-0.1.0-py3-none-any.whl twice")

    b = small(base, "sums-lists-signature")
    add_line(b, f"{'a' * 64}  SHA256SUMS.sig")
    out[b.name] = Case("", "lists itself or its signature")

    b = small(base, "unlisted-wheel")
    (b / "wheels/gpuprov-9.9.9-py3-none-any.whl").write_bytes(trap_wheel(Path("gpuprov-9.9.9-x.whl"), MARKER))
    out[b.name] = Case("", "wheels/gpuprov-9.9.9-py3-none-any.whl is not listed in SHA256SUMS")

    b = small(base, "symlink-out")
    (b / "repo/evil").symlink_to("/etc/shadow")
    out[b.name] = Case("", "repo/evil is a link")

    b = small(base, "setuid")
    (b / "repo/python3.deb").chmod(0o4755)
    out[b.name] = Case("", "repo/python3.deb is a link, a special file or setuid/setgid")

    b = small(base, "fifo")
    os.mkfifo(b / "repo/fifo")
    out[b.name] = Case("", "repo/fifo is a link, a special file")

    b = small(base, "checksum")
    (b / "repo/Packages").write_text("Package: evil\n")
    out[b.name] = Case("", "bundle files do not match SHA256SUMS")

    # Control: the real bundle with the trap, unsigned and declared unsigned, no keyring: accepted, the trap runs.
    b = link_copy(debian12_bundle, base / "zz-control-unsigned")
    arm(b)
    rewrite_sums(b)
    return base, keys, out


@pytest.fixture(scope="module")
def host(cases):
    base, keys, _ = cases
    h = Host(network="none", wheelhouse=False, volumes={base: "/cases", keys: "/keys"})
    try:
        assert h.exec("ls /sys/class/net").stdout.split() == ["lo"]  # the network is really off
        yield h
    finally:
        h.remove()


STATE = ("dpkg-query -W -f '${Package} ${Status}\\n' | sha256sum; ls -d /opt/gpuprov /var/lib/gpuprov "
         f"/usr/local/bin/gpuprov {MARKER} 2>&1 | sort")


def test_tampered_bundles_refused_before_anything_runs(cases, host):
    _, _, out = cases
    before = host.exec(STATE).stdout
    assert "No such file" in before and MARKER in before
    failures = []
    for name, case in sorted(out.items()):
        r = host.exec(f"bash /cases/{name}/install-offline.sh {case.args}", timeout=300)
        ok = r.returncode == 8 and case.why in r.stderr and "nothing from it was run" in r.stderr
        after = host.exec(STATE).stdout
        if not ok or after != before:
            failures.append(f"{name}: rc={r.returncode} stderr={r.stderr.strip()[-300:]!r} state changed:"
                            f" {after != before}")
    assert not failures, "\n".join(failures)


def test_control_the_trap_is_armed(host, cases):
    """Same booby-trapped gpuprov, in a bundle that honestly says it is unsigned: installed and run."""
    r = host.exec("bash /cases/zz-control-unsigned/install-offline.sh", timeout=600)
    assert host.exec(f"cat {MARKER}").stdout == "ran", r.stdout + r.stderr
