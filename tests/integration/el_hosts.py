"""An EL host as a container: Rocky Linux 9 or 8 presented to gpuprov (os-release, redhat-release, dnf and rpm configured
in their EL places, a release package in the rpm database), with Debian's own dnf 4.14 and rpm 4.18 as the package
manager, and stand-in repositories (ELRepo, the distribution's BaseOS/AppStream, Docker CE) built with rpmbuild and
createrepo_c from tests/fixtures/el-repos (where each fact came from: its README) and served over loopback HTTP
inside the host. The host runs with `--network none`: nothing it does can reach an upstream archive.

One image serves every release (the release is installed when a host starts); it is built once and named by a hash
of its recipe; the repositories are built once per recipe into a cache
directory on this machine (both reused across test sessions, as tests/integration/hosts.py's images are).
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from tests.integration.hosts import StandInHost, built_in_container, committed_image, ensure_image, ensure_wheelhouse, sh

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "el-repos"
GPU_PCI = FIXTURE.parent / "hosts" / "h200-vm" / "sys" / "bus" / "pci" / "devices"  # one H200 (10de:2335)
PORT = 8089  # the loopback HTTP server inside the host (its own network namespace: no clash with anything)
APT = "dnf rpm createrepo-c dnf-plugins-core dracut-core python3 python3-venv curl gnupg"
# Where Debian's dnf/rpm differ from EL's, set as EL has them: rpm's database in /var/lib/rpm (Debian: ~/.rpmdb), no
# Debian marker, EL's dnf.conf. The versionlock plugin leaves its Debian place and comes back only with the stand-in
# python3-dnf-plugin-versionlock rpm (its payload is Debian's real plugin), as on EL where that package brings it.
# Debian's dracut is patched to name its image /boot/initrd.img-K; EL's (Fedora's) names it /boot/initramfs-K.img,
# and EL ships hostonly="yes" (which is what puts /etc/modprobe.d into the image): both set back to EL's.
PREP = r"""set -e
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends %(apt)s >/dev/null
apt-get clean
mkdir -p /etc/rpm /var/lib/rpm /etc/yum.repos.d /etc/pki/rpm-gpg /usr/share/el-standin
echo '%%_dbpath /var/lib/rpm' > /etc/rpm/macros
mv /usr/lib/python3/dist-packages/dnf-plugins/versionlock.py /etc/dnf/plugins/versionlock.conf /usr/share/el-standin/
rm -f /etc/dnf/plugins/versionlock.list /etc/debian_version
cp /el/dnf.conf /etc/dnf/dnf.conf
sed -i 's|/boot/initrd.img-${kernel}"|/boot/initramfs-${kernel}.img"|' /usr/bin/dracut
grep -q 'boot/initramfs-${kernel}.img' /usr/bin/dracut
echo 'hostonly="yes"' > /etc/dracut.conf.d/01-dist.conf
rpm --initdb
"""


def el_image() -> str:
    """gpuprov-test/el-dnf:<recipe hash>: Debian minbase + Debian's dnf/rpm set up in EL's places, one image for
    every EL release: the release (rocky-release, os-release) is installed when a host starts (ElHost)."""
    h = hashlib.sha256((PREP + APT).encode() + (FIXTURE / "host" / "dnf.conf").read_bytes())
    return committed_image(f"gpuprov-test/el-dnf:{h.hexdigest()[:12]}", ensure_image(), PREP % {"apt": APT},
                           volumes=(f"{FIXTURE / 'host'}:/el:ro",))


def el_repos() -> Path:
    """The stand-in repositories' tree (served as the HTTP root inside the host), built when missing: every rpm of
    tests/fixtures/el-repos/packages.json with rpmbuild, signed with a throwaway key, in the upstream layouts below
    each repository's base URL. Packages marked `later` are kept aside under later/ (the test publishes them)."""
    cache = Path(os.environ.get("GPUPROV_TEST_EL_REPOS", "/tmp/gpuprov-el-repos"))
    return built_in_container(cache, FIXTURE, el_image(), BUILD)


# Runs inside a container of el_image(): one spec per package of packages.json, built, signed, placed, indexed.
BUILD = r'''
import json, os, subprocess, pathlib, glob, shutil
fx = pathlib.Path("/fx"); out = pathlib.Path("/out"); top = pathlib.Path("/tmp/rb")
pk = json.loads((fx / "packages.json").read_text())
env = dict(os.environ, GNUPGHOME="/tmp/gnupg")
os.makedirs("/tmp/gnupg", mode=0o700)
subprocess.run(["gpg", "--batch", "--passphrase", "", "--quick-gen-key", "gpuprov stand-in signer <el@invalid>",
                "rsa2048", "sign", "never"], check=True, env=env, capture_output=True)
pub = subprocess.run(["gpg", "--armor", "--export"], check=True, env=env, capture_output=True).stdout
def spec(p):
    lines = [f"Name: {p['name']}", f"Version: {p['version']}", f"Release: {p['release']}",
             "Summary: stand-in for " + p['name'], "License: stand-in", f"BuildArch: {p.get('arch', 'x86_64')}"]
    if "epoch" in p: lines.append(f"Epoch: {p['epoch']}")
    for tag in ("Requires", "Provides", "Conflicts", "Obsoletes"):
        lines += [f"{tag}: {v}" for v in p.get(tag.lower(), [])]
    lines += ["AutoReqProv: no", "%description", "stand-in (tests/fixtures/el-repos/README.md)", "%install"]
    files = p.get("files", {})
    for path, src in files.items():
        lines.append(f"mkdir -p %{{buildroot}}$(dirname {path})")
        if src.startswith("@"):
            lines.append(f"cp {src[1:]} %{{buildroot}}{path}")
        elif src == "/":
            lines.append(f"mkdir -p %{{buildroot}}{path}")
        else:
            lines.append(f"printf '%s\\n' {json.dumps(src)} > %{{buildroot}}{path}")
    lines += ["%files"] + [f"%dir {f}" if s == "/" else f for f, s in files.items()]
    lines += SCRIPTLETS[p["scriptlet"]](p) if "scriptlet" in p else []
    return "\n".join(lines) + "\n"
# The scriptlets the real packages run (tests/fixtures/el-repos/README.md says whose): a kernel's %posttrans runs
# kernel-install's plugins (dkms's among them: tests/fixtures/el-repos/payloads), a DKMS module package registers its
# source and builds for the running kernel only, each step's failure ignored.
def kernel_install(p):
    k = f"{p['version']}-{p['release']}.{p.get('arch', 'x86_64')}"
    return ["%posttrans", f"/usr/sbin/weak-modules --add-kernel {k} || exit $?",
            "for h in /usr/lib/kernel/install.d/*.install; do",
            f'  [ -x "$h" ] || continue; "$h" add {k} /lib/modules/{k}/vmlinuz || exit $?', "done"]
def kmod(p):  # ELRepo's kmodtool: depmod and weak-modules for its modules; on removal, the links taken away
    nvr = f"{p['name']}-{p['version']}-{p['release']}.{p.get('arch', 'x86_64')}"
    ko = next(f for f in p["files"] if f.endswith(".ko"))
    listed = f"/run/rpm-{p['name']}-modules"
    return ["%post", f"echo {ko} | /usr/sbin/weak-modules --add-modules",
            "%preun", f"rpm -ql {nvr} | grep '[.]ko$' > {listed}",
            "%postun", f"/usr/sbin/weak-modules --remove-modules < {listed}; rm -f {listed}"]
def dkms_module(p):
    src = next(f for f in p["files"] if f.endswith("/dkms.conf")).split("/")[3]
    mv = f"-m {src.rsplit('-', 1)[0]} -v {src.rsplit('-', 1)[1]}"
    return ["%post", f"dkms add {mv} -q --rpm_safe_upgrade || :", f"dkms build {mv} -q || :",
            f"dkms install {mv} -q --force || :", "%preun", f"dkms remove {mv} -q --all --rpm_safe_upgrade || :"]
SCRIPTLETS = {"kernel-install": kernel_install, "dkms": dkms_module, "kmod": kmod}
def later_dir(later):  # `later: true` is the next update (later/), `later: "minor"` the next minor release's
    return "" if not later else "later" if later is True else f"later-{later}"
gpgkeys = {}
for p in pk["packages"]:
    for k, v in list(p.get("files", {}).items()):
        if v == "@KEY":
            pathlib.Path("/tmp/key.asc").write_bytes(pub); p["files"][k] = "@/tmp/key.asc"
    s = top / "SPECS" / f"{p['name']}-{p['version']}-{p['release']}.spec"; s.parent.mkdir(parents=True, exist_ok=True)
    s.write_text(spec(p))
# one rpmbuild and one rpmsign for all of them (a process each per package tripled the build's time)
subprocess.run(["rpmbuild", "-bb", "--quiet", "--define", f"_topdir {top}", *sorted(map(str, (top / "SPECS").iterdir()))],
               check=True)
rpms = [glob.glob(str(top / "RPMS" / "*" / f"{p['name']}-{p['version']}-{p['release']}.*.rpm"))[0]
        for p in pk["packages"]]
subprocess.run(["rpmsign", "--define", "__gpg /usr/bin/gpg", "--define", "_gpg_name gpuprov stand-in signer",
                "--addsign", *sorted(set(rpms))], check=True, env=env, capture_output=True)
for p, rpm in zip(pk["packages"], rpms):
    dest = out / later_dir(p.get("later")) / p["repo"]
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(rpm, dest / (p.get("file_name") or os.path.basename(rpm)))
for d in pk["repos"]:
    (out / d).mkdir(parents=True, exist_ok=True)
    subprocess.run(["createrepo_c", "-q", str(out / d)], check=True)
# Module streams (modulemd v2, defaults v1), as a repository's `modules` metadata: each stream's artifacts are its
# packages at its versions, by their NEVRAs from the packages built above. JSON is YAML (flow style).
def nevra(p):
    return f"{p['name']}-{p.get('epoch', 0)}:{p['version']}-{p['release']}.{p.get('arch', 'x86_64')}"
docs = {}
for i, m in enumerate(pk.get("modules", [])):
    arts = sorted(nevra(p) for p in pk["packages"] if p["repo"] == m["repo"] and p["name"] in m["artifacts"]
                  and p["version"] in m["versions"])
    data = {"name": m["name"], "stream": m["stream"], "version": 1000 + i, "context": "00000000", "arch": "x86_64",
            "summary": "stand-in " + m["name"], "description": "stand-in (tests/fixtures/el-repos/README.md)",
            "license": {"module": ["stand-in"]},
            "profiles": {k: {"rpms": v} for k, v in m["profiles"].items()}, "artifacts": {"rpms": arts}}
    if m["platform"]:  # none declared: the stream is active on every platform (NVIDIA's rhel8 streams on al8)
        data["dependencies"] = [{"requires": {"platform": [m["platform"]]}}]
    docs.setdefault(m["repo"], []).append({"document": "modulemd", "version": 2, "data": data})
for d in pk.get("module_defaults", []):
    data = {"module": d["module"], "stream": d["stream"], "profiles": d["profiles"]}
    docs.setdefault(d["repo"], []).append({"document": "modulemd-defaults", "version": 1, "data": data})
for repo, ds in docs.items():
    y = pathlib.Path("/tmp/modules.yaml")
    y.write_text("".join("---\n" + json.dumps(d) + "\n...\n" for d in ds))
    subprocess.run(["modifyrepo_c", "--mdtype=modules", str(y), str(out / repo / "repodata")], check=True,
                   capture_output=True)
for f in pk["keys"]:
    (out / f).parent.mkdir(parents=True, exist_ok=True); (out / f).write_bytes(pub)
for f, text in pk["texts"].items():
    (out / f).parent.mkdir(parents=True, exist_ok=True); (out / f).write_text(text)
# Each release's rocky-release and os-release, installed when a host of that release starts (ElHost).
(out / "releases").mkdir()
for r in pk["releases"]:
    defs = [a for k in ("major", "rv", "rr", "codename") for a in ("--define", f"{k} {r[k]}")]
    subprocess.run(["rpmbuild", "-bb", "--quiet", "--define", "_topdir /tmp/rel", *defs,
                    "/fx/host/rocky-release.spec"], check=True)
    rpm = glob.glob(f"/tmp/rel/RPMS/noarch/rocky-release-{r['rv']}-{r['rr']}.noarch.rpm")[0]
    shutil.copy(rpm, out / "releases" / f"rocky-release-el{r['major']}.rpm")
    shutil.copy(fx / "host" / f"os-release-{r['major']}", out / "releases" / f"os-release-el{r['major']}")
# The other releases (Amazon Linux 2023, Alibaba Cloud Linux 3): their own release package's spec, installed the same
# way.
for r in pk.get("other_releases", []):
    subprocess.run(["rpmbuild", "-bb", "--quiet", "--define", "_topdir /tmp/rel", f"/fx/host/{r['spec']}"], check=True)
    shutil.copy(f"/tmp/rel/RPMS/noarch/{r['rpm']}", out / "releases" / f"release-{r['name']}.rpm")
    shutil.copy(fx / "host" / f"os-release-{r['name']}", out / "releases" / f"os-release-{r['name']}")
'''


class ElHost(StandInHost):
    """A Rocky host container (major "9" or "8"), or one of packages.json's `other_releases` (major "amzn2023" or
    "alinux3"), `--network none`, the stand-in repositories served on 127.0.0.1:PORT inside it. `gpu`: a server with
    its GPU on the PCI bus (tests/fixtures/hosts/h200-vm's PCI devices, an H200, bound over /sys/bus/pci/devices), so
    gpuprov plans for the GPU it finds rather than baking for one (--for-gpu)."""

    def __init__(self, major: str = "9", gpu: bool = False):
        self.major = major
        self.name = f"el-host-{uuid.uuid4().hex[:8]}"
        repos = el_repos()
        pci = ("-v", f"{GPU_PCI}:/sys/bus/pci/devices:ro") if gpu else ()
        # /run a tmpfs, as on a server: a restart (the reboot) empties it
        sh("docker", "run", "-d", "--name", self.name, "--network", "none", "--tmpfs", "/run", *pci,
           "-v", f"{repos}:/srv/repos:ro", "-v", f"{ensure_wheelhouse()}:/wh:ro", el_image())
        # The release installed as the installer leaves it (its release package in rpm's database, os-release); the
        # served tree is a copy (later/ gets published into it); the distribution's key is in place as an installed
        # host has it (the release package ships it), imported into rpm as the installer does.
        other = {r["name"]: r for r in packages_table().get("other_releases", [])}.get(major)
        rpm, osr = (f"release-{major}.rpm", f"os-release-{major}") if other else \
            (f"rocky-release-el{major}.rpm", f"os-release-el{major}")
        served = other["key"] if other else f"rocky/RPM-GPG-KEY-Rocky-{major}"
        key = f"/etc/pki/rpm-gpg/{served.rsplit('/', 1)[1]}"
        self.exec(f"set -e; rpm -i --nodeps /srv/repos/releases/{rpm} /srv/repos/base/*.rpm; "
                  f"cp /srv/repos/releases/{osr} /etc/os-release; "
                  "cp -a /srv/repos /srv/www; rm -rf /srv/www/later /srv/www/later-*; "
                  f"install -m0644 /srv/www/{served} {key}; rpm --import {key}", check=True)
        self.serve()

    def serve(self) -> None:
        self.spawn(f"cd /srv/www && exec python3 -m http.server --bind 127.0.0.1 {PORT} >/var/log/repos.log 2>&1")
        self.exec(f"for i in $(seq 50); do curl -fs http://127.0.0.1:{PORT}/ >/dev/null && exit 0; sleep 0.1; done; "
                  "exit 1", check=True)

    def reboot(self) -> None:
        """The host restarted: /run (a tmpfs) emptied, so no reboot is pending; the repositories served again."""
        sh("docker", "restart", "-t", "1", self.name)
        self.serve()

    def publish_later(self, repo: str, group: str = "later") -> None:
        """An upstream update: the kept-aside packages of `repo` join it, and its metadata is regenerated. `group`:
        later (packages.json's `later: true`) or later-minor (`later: "minor"`: the next minor release's)."""
        self.exec(f"set -e; cp /srv/repos/{group}/{repo}/*.rpm /srv/www/{repo}/; "
                  f"createrepo_c -q --update /srv/www/{repo}", check=True)

    def pm_config(self) -> dict[str, str]:
        """dnf's and rpm's configuration: each repository file, key file and versionlock list (with what rpm leaves of
        them: .rpmsave) -> its checksum, and each key imported into rpm (gpg-pubkey-…) -> "imported"."""
        out = self.exec("sha256sum /etc/yum.repos.d/* /etc/pki/rpm-gpg/* /etc/dnf/plugins/versionlock.list* "
                        "2>/dev/null; rpm -q gpg-pubkey --qf '%{NAME}-%{VERSION}-%{RELEASE} imported\\n'").stdout
        rows = [ln.split() for ln in out.splitlines() if len(ln.split()) == 2]
        return {(a if b == "imported" else b): (b if b == "imported" else a) for a, b in rows}

    def rpms(self) -> dict[str, str]:
        """Installed packages: name -> epoch:version-release (epoch 0 when none)."""
        out = self.exec("rpm -qa --qf '%{NAME} %{EPOCHNUM}:%{VERSION}-%{RELEASE}\\n'", check=True).stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if line)



def url(path: str = "") -> str:
    return f"http://127.0.0.1:{PORT}/{path}"


def packages_table() -> dict:
    return json.loads((FIXTURE / "packages.json").read_text())
