"""A bundle's signing key must be valid, not just known: gpgv exits 0 for a good signature by an expired or revoked
key, so verification reads gpg's machine-readable status (`--status-fd`) and wants a VALIDSIG with none of
EXPKEYSIG, REVKEYSIG, EXPSIG, BADSIG. Real gpg keys made here: one made in 2020 that expired a day later (gpg's
--faked-system-time), one revoked with the revocation certificate gpg made with it, a signature that expired, and a
signature over other bytes. Each is refused (exit 8, the reason in one line) by `gpuprov bundle verify` and by the
bundle's own install-offline.sh (run with the host's gpgv in a Debian 12 container, network off), and a bundle
signed by a valid key still passes both."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.bundles import make_signer, small_bundle
from tests.conftest import have_docker, needs, run_cli

pytestmark = needs("gpg", "gpgv")
PAST = "20200101T000000"  # the keys' creation time for the expired cases
SIGNED_THEN = "20200101T120000"  # within the expired key's one day of life


@dataclass
class Case:
    bundle: Path
    keyring: Path
    why: str  # the refusal's words; "" for the control


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    base = tmp_path_factory.mktemp("keys")
    out: dict[str, Case] = {}

    def bundle(name: str) -> Path:
        return small_bundle(base / "bundles" / name)

    good = make_signer(base / "good")
    b = bundle("valid")
    good.sign(b)
    out["valid"] = Case(b, good.keyring, "")

    expired = make_signer(base / "expired", "expired@gpuprov.invalid", at=PAST, expire="1d")
    b = bundle("expired-key")
    expired.sign(b, at=SIGNED_THEN)
    out["expired-key"] = Case(b, expired.keyring, "was made by an expired key")

    revoked = make_signer(base / "revoked", "revoked@gpuprov.invalid")
    b = bundle("revoked-key")
    revoked.sign(b)
    revoked.revoke()
    out["revoked-key"] = Case(b, revoked.keyring, "was made by a revoked key")

    old = make_signer(base / "old", "old@gpuprov.invalid", at=PAST)
    b = bundle("expired-signature")
    old.sign(b, at=SIGNED_THEN, sig_expire="1d")
    out["expired-signature"] = Case(b, old.keyring, "has expired")

    b = bundle("bad-signature")
    good.sign(b)
    shutil.copy(out["valid"].bundle / "SHA256SUMS.sig", b / "SHA256SUMS.sig")  # a good key's signature, other bytes
    out["bad-signature"] = Case(b, good.keyring, "does not verify")
    return out


NAMES = ["valid", "expired-key", "revoked-key", "expired-signature", "bad-signature"]


def test_gpgv_alone_accepts_expired_and_revoked_keys(cases):
    """Why the status lines are needed: gpgv's exit status is 0 for both (the cases are what they claim)."""
    for name, status in (("expired-key", "EXPKEYSIG"), ("revoked-key", "REVKEYSIG")):
        c = cases[name]
        p = subprocess.run(["gpgv", "--status-fd", "1", "--keyring", str(c.keyring), str(c.bundle / "SHA256SUMS.sig"),
                            str(c.bundle / "SHA256SUMS")], capture_output=True, text=True)
        assert p.returncode == 0 and f"[GNUPG:] {status} " in p.stdout and "[GNUPG:] VALIDSIG " in p.stdout


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("with_keyring", [True, False], ids=["keyring", "manifest-keys"])
def test_bundle_verify(cases, name, with_keyring):
    c = cases[name]
    env = {} if with_keyring else {"GNUPGHOME": str(c.keyring.parent / "gnupg")}  # gpgv: the home's trustedkeys
    if not with_keyring:  # without --keyring, gpgv reads trustedkeys.kbx in GNUPGHOME (root's own, in production)
        shutil.copy(c.keyring, c.keyring.parent / "gnupg/trustedkeys.gpg")
    r = run_cli("bundle", "verify", str(c.bundle), *(["--keyring", str(c.keyring)] if with_keyring else []),
                env=env, timeout=120)
    if not c.why:
        assert r.returncode == 0 and "signature good" in r.stdout, r.stderr
        return
    assert r.returncode == 8, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"signature of SHA256SUMS {c.why}" in err, err


@pytest.mark.skipif(not have_docker(), reason="needs a Docker engine (install-offline.sh runs in a Debian 12 host)")
def test_install_offline_script(cases, tmp_path):
    """Every case through the bundle's own script, in one container of the Debian 12 image (gpgv, sha256sum from
    the image): the refusals exit 8 before anything runs. GPUPROV_ONLY_INSTALL=1 with no network: the valid bundle
    gets past every check (it then fails only at installing its placeholder packages, not with exit 8)."""
    from tests.integration.hosts import ensure_image

    mounts = []
    for name in NAMES:
        mounts += ["-v", f"{cases[name].bundle}:/b/{name}:ro", "-v", f"{cases[name].keyring}:/k/{name}.gpg:ro"]
    loop = "".join(f"bash /b/{n}/install-offline.sh --keyring /k/{n}.gpg >/dev/null 2>/tmp/err; "
                   f"echo \"{n} $? $(head -c 300 /tmp/err | tr '\\n' ' ')\"; " for n in NAMES)
    p = subprocess.run(["docker", "run", "--rm", "--network", "none", *mounts, "-e", "GPUPROV_ONLY_INSTALL=1",
                        ensure_image(), "bash", "-c", loop], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = {ln.split(" ", 1)[0]: ln.split(" ", 2)[1:] for ln in p.stdout.splitlines()}
    for name in NAMES:
        rc, err = int(got[name][0]), got[name][1] if len(got[name]) > 1 else ""
        if cases[name].why:
            assert rc == 8 and f"the signature of SHA256SUMS {cases[name].why}" in err, (name, rc, err)
        else:
            assert rc != 8 and "signature" not in err, (name, rc, err)
