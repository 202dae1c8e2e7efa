"""An Ubuntu host as a container: Ubuntu 22.04 or 24.04 presented to gpuprov (os-release, lsb-release, debian_version,
the archive key in Ubuntu's place, the sources in Ubuntu's format: sources.list on 22.04, deb822 ubuntu.sources on
24.04), with Debian's own apt and dpkg as the package manager (Ubuntu's package manager is apt itself), and a
stand-in Ubuntu archive built from tests/fixtures/ubuntu-archive (where each fact came from: its README) with
dpkg-deb and apt-ftparchive, signed with a throwaway key, served over loopback HTTP inside the host as a site's
internal mirror of the Ubuntu archive would be. The host runs with `--network none`.

What is real: apt's resolution, transactions, pins, Conflicts/Provides/Replaces, maintainer scripts, run-parts of
/etc/kernel/{postinst.d,header_postinst.d} (as Ubuntu's kernel packages run them), initramfs-tools building an image
per kernel, DKMS (Debian's 3.0.10: add, build, install, autoinstall from the kernel hooks), depmod and modinfo.
What is stand-in: every package's payload (a kernel image that is text, modules that are ELF objects carrying only
a .modinfo section, libraries that are empty shared objects), and the DKMS build itself (dkms.conf's MAKE compiles
those objects instead of the driver against the kernel's headers).

One image for the family (both releases: the identity files are written when a host starts) and the archive, both
built once and named by a hash of their recipe (reused across test sessions, as tests/integration/hosts.py's images
are).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import uuid
from pathlib import Path

from tests.integration.hosts import NESTED, StandInHost, built_in_container, committed_image, ensure_image, ensure_wheelhouse, sh

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ubuntu-archive"
DISTROS = Path(__file__).resolve().parents[1] / "fixtures" / "distros"
GPU_HOST = Path(__file__).resolve().parents[1] / "fixtures" / "hosts" / "h200-vm"  # its sysfs: one H200 (10de:2335)
PORT = 8090  # the loopback HTTP server inside the host (its own network namespace)
# Debian's apt/dpkg (minbase), Python for gpuprov, and what an Ubuntu server has for kernels and DKMS: kmod,
# initramfs-tools, dkms (with the compiler it depends on), openssl (DKMS's signing key). apt-utils and gnupg build
# the archive in the same image.
# systemd (PID 1 of the engine hosts) and what an Ubuntu server has that docker.io's libraries and scripts need
# (iptables, adduser, libdevmapper, tini, libseccomp). Debian's docker.io, containerd and runc are downloaded, not
# installed: the archive BUILD repackages them under Ubuntu's names, versions and Depends (packages.json), so the
# engine an Ubuntu host installs from the stand-in archive is a real one.
# unattended-upgrades: an Ubuntu server has it installed (issue 43 runs it to bring a kernel); its periodic run stays
# off (no 20auto-upgrades), so it runs only when a test runs it.
# grub2-common (and grub-common): GRUB's own grub-mkconfig, update-grub, grub-set-default and 10_linux (Debian's
# 2.06, the version 22.04 ships), no boot loader installed: a host that calls UbuntuHost.grub() gets a grub.cfg.
APT = ("python3 python3-venv kmod initramfs-tools dkms openssl apt-utils gnupg "
       "systemd systemd-sysv dbus iptables adduser libdevmapper1.02.1 tini libseccomp2 curl unattended-upgrades "
       "grub2-common")
# grub-probe answers for the root filesystem; a container's is an overlay no GRUB can read, so a stand-in answers as
# for an ext4 root on /dev/sda1 (grub-probe's --target values that 00_header and 10_linux ask). Diverted, so
# grub-mkconfig's own /usr/sbin/grub-probe is this one.
GRUB_UUID = "3f5d2e7c-8a10-4b8e-9d1a-6d2c1a9e5b1e"
GRUB_PROBE = r"""#!/bin/sh
t=; prev=
for a in "$@"; do
  case "$a" in --target=*) t=${a#--target=};; esac
  { [ "$prev" = -t ] || [ "$prev" = --target ]; } && t=$a
  prev=$a
done
case "$t" in
  device) echo /dev/sda1;; fs) echo ext2;; fs_uuid) echo GRUB_UUID;; partmap) echo msdos;; abstraction) ;;
  drive) echo '(hd0,msdos1)';; compatibility_hint) echo hd0,msdos1;; hints_string) echo '--hint-bios=hd0,msdos1';;
  partuuid) echo 1234-01;; disk) echo /dev/sda;;
esac
""".replace("GRUB_UUID", GRUB_UUID)
ENGINE_DEBS = "/opt/debian-engine"
PREP = r"""set -e
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends %(apt)s >/dev/null
rm -f /etc/apt/apt.conf.d/20auto-upgrades
mkdir -p %(engine)s && cd %(engine)s && apt-get download -qq docker.io containerd runc
apt-get clean
rm -rf /var/lib/apt/lists/* /etc/apt/sources.list /etc/apt/sources.list.d/*
"""
RELEASES = {"22.04": "jammy", "24.04": "noble"}


def ubuntu_image() -> str:
    """gpuprov-test/ubuntu-apt:<recipe hash>: Debian minbase + Debian's apt/dpkg, kmod, initramfs-tools, dkms."""
    tag = hashlib.sha256((PREP + APT + ENGINE_DEBS).encode()).hexdigest()[:12]
    return committed_image(f"gpuprov-test/ubuntu-apt:{tag}", ensure_image(), PREP % {"apt": APT, "engine": ENGINE_DEBS})


def ubuntu_archive() -> Path:
    """The stand-in archive's tree, built when missing: www/ (served: pool/, dists/<release> and an empty
    dists/<release>-updates, signed) and later/<release>-updates (the update a test publishes), plus key.gpg."""
    cache = Path(os.environ.get("GPUPROV_TEST_UBUNTU_ARCHIVE", "/tmp/gpuprov-ubuntu-archive"))
    return built_in_container(cache, FIXTURE, ubuntu_image(), BUILD)



# Runs inside a container of ubuntu_image(): packages.json expanded into .debs (dpkg-deb), indexed (apt-ftparchive)
# and signed (gpg), one suite per release and its -updates.
BUILD = r'''
import json, os, subprocess, pathlib, shutil, textwrap, time
fx = pathlib.Path("/fx"); out = pathlib.Path("/out"); work = pathlib.Path("/tmp/build")
table = json.loads((fx / "packages.json").read_text())
COMPS = ("main", "restricted", "universe", "multiverse")
KERNEL_TEAM = "Ubuntu Kernel Team <kernel-team@lists.ubuntu.com>"
CORE = "Ubuntu Core Developers <ubuntu-devel-discuss@lists.ubuntu.com>"
built = {}  # (suite, comp) -> [deb paths]
objs = {}
signed_kernels = set()  # (suite, kernel): its linux-signatures-nvidia-<kernel> built

def modobj(name, version, kernel):
    """An ELF object with only a .modinfo section: what modinfo and depmod read of a module."""
    key = (name, version, kernel)
    if key not in objs:
        d = work / "objs" / f"{kernel}-{version}"; d.mkdir(parents=True, exist_ok=True)
        c = d / f"{name}.c"
        c.write_text("".join(f'__attribute__((section(".modinfo"), used)) static const char m{i}[] = "{v}";\n'
                             for i, v in enumerate([f"version={version}", "license=Dual MIT/GPL", f"name={name}",
                                                    f"vermagic={kernel} SMP mod_unload modversions "])))
        subprocess.run(["gcc", "-c", "-o", str(d / f"{name}.ko"), str(c)], check=True)
        objs[key] = d / f"{name}.ko"
    return objs[key]

def sharedobj(soname):
    p = work / "so" / soname
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.parent / "e.c").write_text("int gpuprov_stand_in;\n")
        subprocess.run(["gcc", "-shared", "-nostdlib", "-o", str(p), f"-Wl,-soname,{soname}", str(p.parent / "e.c")], check=True)
    return p

def deb(suite, comp, name, version, *, source=None, maint=CORE, depends="", provides="", conflicts="",
        replaces="", files=None, scripts=None, section="misc", desc=None, pool=None):
    """One .deb: files maps a path to text, a Path (copied) or ("link", target); pool: where it goes instead of
    www/pool/<suite>/<comp> (NVIDIA's flat repository)."""
    root = work / "pkg" / f"{name}_{version}"
    shutil.rmtree(root, ignore_errors=True)
    (root / "DEBIAN").mkdir(parents=True)
    files = dict(files or {})
    files.setdefault(f"/usr/share/doc/{name}/stand-in", "stand-in payload: tests/fixtures/ubuntu-archive/README.md\n")
    for path, content in files.items():
        dest = root / path.lstrip("/"); dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, tuple):
            os.symlink(content[1], dest)
        elif isinstance(content, pathlib.Path):
            shutil.copy(content, dest)
        else:
            dest.write_text(content)
            if path.startswith("/usr/bin/"):
                dest.chmod(0o755)
    ctl = [f"Package: {name}", f"Version: {version}", "Architecture: amd64", f"Maintainer: {maint}",
           f"Section: {comp + '/' if comp != 'main' else ''}{section}", "Priority: optional"]
    if source:
        ctl.append(f"Source: {source}")
    for field, value in (("Depends", depends), ("Provides", provides), ("Conflicts", conflicts),
                         ("Replaces", replaces)):
        if value:
            ctl.append(f"{field}: {value}")
    ctl.append(f"Description: {desc or 'stand-in for ' + name}")
    (root / "DEBIAN" / "control").write_text("\n".join(ctl) + "\n")
    for sname, text in (scripts or {}).items():
        s = root / "DEBIAN" / sname
        s.write_text("#!/bin/sh\nset -e\n" + textwrap.dedent(text)); s.chmod(0o755)
    pool = pool or out / "www" / "pool" / suite / comp; pool.mkdir(parents=True, exist_ok=True)
    path = pool / f"{name}_{version.split(':')[-1]}_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "-b", str(root), str(path)], check=True,
                   capture_output=True)
    built.setdefault((suite, comp), []).append(path)

def relink():
    # Ubuntu's kernel postinst (linux-update-symlinks): /boot/vmlinuz and /boot/initrd.img name the newest kernel
    return """
    newest=$(ls /boot/vmlinuz-* 2>/dev/null | sed 's|^/boot/vmlinuz-||' | sort -V | tail -n1)
    if [ -n "$newest" ]; then ln -sfn "vmlinuz-$newest" /boot/vmlinuz; ln -sfn "initrd.img-$newest" /boot/initrd.img
    else rm -f /boot/vmlinuz /boot/initrd.img; fi
    """

def repack(suite, e):
    """Debian's own package (downloaded into the image) under Ubuntu's name, version, Depends and Conflicts: the
    payload is Debian's real binaries and maintainer scripts (the systemd unit, the docker group), the control
    fields Ubuntu's. Provenance in the control file (X-Gpuprov-Stand-In) and the README."""
    src = next(pathlib.Path("/opt/debian-engine").glob(e["name"] + "_*.deb"))
    root = work / "repack" / e["name"]; shutil.rmtree(root, ignore_errors=True); root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "-R", str(src), str(root)], check=True)
    ctl = (root / "DEBIAN" / "control").read_text().splitlines()
    orig = next(ln.split(": ", 1)[1] for ln in ctl if ln.startswith("Version: "))
    keep = [ln for ln in ctl if not ln.startswith(("Version:", "Depends:", "Conflicts:", "Breaks:", "Maintainer:",
                                                   "Section:", "Description:"))
            and not ln.startswith(" ")]
    fields = {"Version": e["version"], "Maintainer": CORE, "Section": e["component"] + "/admin",
              "Depends": e.get("depends", ""), "Conflicts": e.get("conflicts", ""),
              "X-Gpuprov-Stand-In": f"Debian bookworm {e['name']} {orig}, repackaged",
              "Description": f"stand-in for Ubuntu's {e['name']} (Debian's binaries)"}
    (root / "DEBIAN" / "control").write_text("\n".join(keep + [f"{k}: {v}" for k, v in fields.items() if v]) + "\n")
    pool = out / "www" / "pool" / suite / e["component"]; pool.mkdir(parents=True, exist_ok=True)
    path = pool / f"{e['name']}_{e['version'].split(':')[-1]}_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "-b", str(root), str(path)], check=True,
                   capture_output=True)
    built.setdefault((suite, e["component"]), []).append(path)

def series(suite, comp, d, pool=None):
    """One driver series as Ubuntu packages it (NVIDIA's repository for Ubuntu uses the same names): the shared
    packages, the DKMS module source, the headless and full metapackages, each of both module flavours."""
    V = d["version"]; up = V.split("-")[0]; s = d["series"]; src = d["source"]
    def debp(*a, **k):
        deb(*a, pool=pool, **k)
    common = f"nvidia-kernel-common-{s} (= {V})"
    debp(suite, comp, f"nvidia-kernel-common-{s}", V, source=src, provides="nvidia-kernel-common",
        conflicts="nvidia-kernel-common", replaces="nvidia-kernel-common")
    debp(suite, comp, f"nvidia-firmware-{s}-{up}", V, source=src,
        files={f"/lib/firmware/nvidia/{up}/gsp_ga10x.bin": "stand-in\n"})
    debp(suite, comp, f"libnvidia-compute-{s}", V, source=src, section="libs",
        provides="libnvidia-compute", conflicts="libnvidia-compute", replaces="libnvidia-compute",
        files={f"/usr/lib/x86_64-linux-gnu/libcuda.so.{up}": sharedobj("libcuda.so.1"),
               "/usr/lib/x86_64-linux-gnu/libcuda.so.1": ("link", f"libcuda.so.{up}"),
               f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{up}": sharedobj("libnvidia-ml.so.1"),
               "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1": ("link", f"libnvidia-ml.so.{up}")})
    debp(suite, comp, f"nvidia-utils-{s}", V, source=src, provides="nvidia-utils",
        conflicts="nvidia-utils", replaces="nvidia-utils", depends=f"libnvidia-compute-{s}",
        files={"/usr/bin/nvidia-smi": "#!/bin/sh\necho 'NVIDIA-SMI has failed because it couldn'\"'\"'t "
                                      "communicate with the NVIDIA driver.' >&2\nexit 9\n"})
    debp(suite, comp, f"nvidia-compute-utils-{s}", V, source=src, provides="nvidia-compute-utils",
        conflicts="nvidia-compute-utils", replaces="nvidia-compute-utils", depends=f"libnvidia-compute-{s}")
    for opn in ("", "-open"):
        S = s + opn
        name, ver = d["dkms_name"], up
        build = ("#!/bin/sh\nset -e\nfor m in nvidia nvidia-uvm nvidia-modeset; do printf '%s\\n' "
                 "\"__attribute__((section(\\\".modinfo\\\"), used)) static const char v[] = \\\"version="
                 + up + "\\\";\" \"__attribute__((section(\\\".modinfo\\\"), used)) static const char l[] = "
                 "\\\"license=Dual MIT/GPL\\\";\" \"__attribute__((section(\\\".modinfo\\\"), used)) static "
                 "const char n[] = \\\"name=$m\\\";\" \"__attribute__((section(\\\".modinfo\\\"), used)) static "
                 "const char k[] = \\\"vermagic=$1 SMP mod_unload modversions \\\";\" > $m.c; "
                 "gcc -c -o $m.ko $m.c; done\n")
        conf = (f'PACKAGE_NAME="{name}"\nPACKAGE_VERSION="{ver}"\nAUTOINSTALL="yes"\n'
                'MAKE[0]="sh ./build.sh ${kernelver}"\nCLEAN="rm -f *.ko *.c"\n'
                + "".join(f'BUILT_MODULE_NAME[{i}]="{m}"\nDEST_MODULE_LOCATION[{i}]="/updates/dkms"\n'
                          f'STRIP[{i}]="no"\n' for i, m in enumerate(("nvidia", "nvidia-uvm", "nvidia-modeset"))))
        # dh_dkms's maintainer scripts, as Ubuntu's nvidia-dkms packages carry them
        debp(suite, comp, f"nvidia-dkms-{S}", V, source=src, section="kernel",
            depends=f"dkms, {common}, nvidia-kernel-source-{S} (= {V})", provides="nvidia-dkms-kernel",
            conflicts="nvidia-dkms-kernel",
            files={f"/usr/src/{name}-{ver}/dkms.conf": conf, f"/usr/src/{name}-{ver}/build.sh": build},
            scripts={"postinst": f"""
                if [ "$1" = configure ]; then /usr/lib/dkms/common.postinst {name} {ver} "" "" "$2"; fi
                """,
                     "prerm": f"""
                if [ "$(dkms status -m {name} -v {ver})" ]; then dkms remove -m {name} -v {ver} --all; fi
                """})
        debp(suite, comp, f"nvidia-kernel-source-{S}", V, source=src, section="kernel",
            provides="nvidia-kernel-source", conflicts="nvidia-kernel-source")
        nodkms = (f"{common}, libnvidia-compute-{s} (= {V}), nvidia-compute-utils-{s} (= {V}), "
                  f"nvidia-firmware-{s}-{up} (= {V}), nvidia-kernel-source-{S} (= {V})")
        debp(suite, comp, f"nvidia-headless-no-dkms-{S}", V, source=src, depends=nodkms)
        debp(suite, comp, f"nvidia-headless-{S}", V, source=src,
            depends=f"nvidia-headless-no-dkms-{S} (= {V}), nvidia-dkms-{S} (= {V})")
        debp(suite, comp, f"nvidia-driver-{S}", V, source=src,
            depends=f"nvidia-headless-{S} (= {V}), nvidia-utils-{s} (= {V}), libnvidia-compute-{s} (= {V})")


def stages(entry):
    """The later stages an entry is published in (`later`: true is the "updates" stage; a list names several);
    [] for the release suite itself."""
    later = entry.get("later")
    return ["updates"] if later is True else list(later or [])

def pool_suite(rel, stage):
    """Each stage's own pool (its Packages index is built from that directory alone): the "updates" stage keeps
    <rel>-updates, the stand-in's first and only one before issue 43."""
    return rel + "-updates" if stage == "updates" else f"{rel}-updates-{stage}"

for rel, r in table["releases"].items():
    upd = rel + "-updates"
    for k, stage in [(k, s) for k in r["kernels"] for s in (stages(k) or [None])]:
        suite = pool_suite(rel, stage) if stage else rel
        kf = k.get("kflavour", k["flavour"]); K = f"{k['abi']}-{kf}"; f = k["flavour"]
        signed = "linux-signed" + k["source"][len("linux"):]
        deb(suite, "main", f"linux-image-{K}", k["version"], source=signed, maint=KERNEL_TEAM, section="kernel",
            depends="kmod", files={f"/boot/vmlinuz-{K}": f"stand-in kernel image {K}\n",
                                   f"/boot/config-{K}": "CONFIG_MODULES=y\nCONFIG_BLK_DEV_INITRD=y\nCONFIG_RD_GZIP=y\n",
                                   f"/lib/modules/{K}/modules.order": "", f"/lib/modules/{K}/modules.builtin": "",
                                   f"/lib/modules/{K}/modules.builtin.modinfo": "",
                                   f"/lib/modules/{K}/kernel/stand-in": ""},
            scripts={"postinst": f"""
                [ "$1" = configure ] || exit 0
                depmod -a {K}
                run-parts --report --exit-on-error --arg={K} --arg=/boot/vmlinuz-{K} /etc/kernel/postinst.d
                {relink()}""",
                     "prerm": f"""
                [ "$1" = remove ] || exit 0
                run-parts --report --exit-on-error --arg={K} --arg=/boot/vmlinuz-{K} /etc/kernel/prerm.d
                """,
                     "postrm": f"""
                [ "$1" = remove ] || [ "$1" = purge ] || exit 0
                run-parts --report --arg={K} --arg=/boot/vmlinuz-{K} /etc/kernel/postrm.d || true
                rm -f /boot/initrd.img-{K} /lib/modules/{K}/modules.*
                {relink()}"""})
        deb(suite, "main", f"linux-headers-{K}", k["version"], source=k["source"], maint=KERNEL_TEAM,
            section="kernel", files={f"/usr/src/linux-headers-{K}/Makefile": "# stand-in\n",
                                     f"/usr/src/linux-headers-{K}/.config": "CONFIG_MODULES=y\n",
                                     f"/usr/src/linux-headers-{K}/include/generated/utsrelease.h":
                                         f'#define UTS_RELEASE "{K}"\n',
                                     f"/lib/modules/{K}/build": ("link", f"/usr/src/linux-headers-{K}")},
            scripts={"postinst": f"""
                [ "$1" = configure ] || exit 0
                run-parts --report --exit-on-error --arg={K} /etc/kernel/header_postinst.d
                """})
        mv = k["meta_version"]
        deb(suite, "main", f"linux-image-{f}", mv, source=k["meta_source"], maint=KERNEL_TEAM, section="kernel",
            depends=f"linux-image-{K}")
        deb(suite, "main", f"linux-headers-{f}", mv, source=k["meta_source"], maint=KERNEL_TEAM, section="kernel",
            depends=f"linux-headers-{K}")
        deb(suite, "main", k["meta"], mv, source=k["meta_source"], maint=KERNEL_TEAM, section="kernel",
            depends=f"linux-image-{f} (= {mv}), linux-headers-{f} (= {mv})")
        # lrm false: not built for this ABI yet; lrm_in: the later stages in which Canonical has published them (the
        # kernel's own stages without them: the days between a kernel upload and its precompiled modules)
        if f in r["precompiled_flavours"] and k.get("lrm", True) and (stage is None or stage in k.get("lrm_in", [stage])):
            for d in r["drivers"]:
                if d.get("transitional_to"):
                    continue
                up = d["version"].split("-")[0]; b = d["series"].split("-")[0]
                for opn in ("", "-open"):
                    S = d["series"] + opn
                    mods = {f"/lib/modules/{K}/kernel/nvidia-{b}srv{opn}/{m}.ko": modobj(m, up, K)
                            for m in ("nvidia", "nvidia-uvm", "nvidia-modeset")}
                    # as Canonical splits them: the objects the module links from (depending on nothing, so a
                    # branch change leaves them installed) and one kernel's signatures, shared by every series
                    deb(suite, "restricted", f"linux-objects-nvidia-{S}-{K}", k["version"], source=r["lrm_source"][f],
                        maint=KERNEL_TEAM, section="kernel",
                        files={f"/usr/lib/linux/objects/{K}/{S}/nv-kernel.o_binary": "stand-in\n"})
                    if (suite, K) not in signed_kernels:
                        signed_kernels.add((suite, K))
                        deb(suite, "restricted", f"linux-signatures-nvidia-{K}", k["version"],
                            source=r["lrm_source"][f], maint=KERNEL_TEAM, section="kernel",
                            files={f"/usr/lib/linux/signatures/{K}/stand-in": "stand-in\n"})
                    deb(suite, "restricted", f"linux-modules-nvidia-{S}-{K}", k["version"],
                        source=r["lrm_source"][f], maint=KERNEL_TEAM, section="kernel",
                        depends=f"linux-image-{K}, nvidia-kernel-common-{d['series']} (>= {up}), "
                                f"linux-objects-nvidia-{S}-{K} (= {k['version']}), "
                                f"linux-signatures-nvidia-{K} (= {k['version']})", files=mods,
                        scripts={"postinst": f'[ "$1" = configure ] && depmod -a {K} || true\n',
                                 "postrm": f'[ -d /lib/modules/{K} ] && depmod -a {K} || true\n'})
                    deb(suite, "restricted", f"linux-modules-nvidia-{S}-{f}", mv, source=k["meta_source"],
                        maint=KERNEL_TEAM, section="kernel",
                        depends=f"linux-modules-nvidia-{S}-{K} (= {k['version']})")
    for d in r["drivers"]:
        suite = upd if d.get("later") else rel
        V = d["version"]; up = V.split("-")[0]; s = d["series"]; src = d["source"]
        if d.get("transitional_to"):
            # Ubuntu retires a branch by shipping its packages, at the newer branch's version, as transitional
            # packages that depend on the newer branch's.
            t = d["transitional_to"]
            names = [f"nvidia-kernel-common-{s}", f"libnvidia-compute-{s}", f"nvidia-utils-{s}",
                     f"nvidia-compute-utils-{s}"]
            for opn in ("", "-open"):
                names += [f"nvidia-headless-{s}{opn}", f"nvidia-headless-no-dkms-{s}{opn}", f"nvidia-dkms-{s}{opn}",
                          f"nvidia-kernel-source-{s}{opn}", f"nvidia-driver-{s}{opn}"]
            for n in names:
                deb(suite, "restricted", n, V, source=src, section="oldlibs", depends=f"{n.replace(s, t)} (= {V})",
                    desc=f"Transitional package for {n.replace(s, t)}")
            continue
        series(suite, "restricted", d)
    for e in r["engine"]:
        if r.get("real_engines"):  # Debian's binaries (tested on 22.04); elsewhere control fields only, no payload
            repack(rel, e)
        else:
            deb(rel, e["component"], e["name"], e["version"], depends=e.get("depends", ""),
                conflicts=e.get("conflicts", ""))

# NVIDIA's CUDA repository for Ubuntu: one flat repository per release (cuda/ubuntu2204/x86_64/), the same package
# names as Ubuntu's at NVIDIA's versions, and the metapackages NVIDIA adds (nvidia-open-<b>, cuda-drivers-<b>)
for tree, r in table["nvidia_repo"].items():
    flat = out / "www" / "cuda" / tree / "x86_64"
    for d in r["drivers"]:
        series(tree, "nvidia", d, pool=flat)
        V = d["version"]; b = d["series"]
        deb(tree, "nvidia", f"nvidia-open-{b}", V, source=r["meta_source"], pool=flat,
            depends=f"nvidia-driver-{b}-open (= {V})")
        deb(tree, "nvidia", f"cuda-drivers-{b}", V, source=r["meta_source"], pool=flat,
            depends=f"nvidia-driver-{b} (= {V})")

# index and sign: www/dists/<rel> and an empty www/dists/<rel>-updates; later/<rel>-updates with the update
env = dict(os.environ, GNUPGHOME="/tmp/gnupg"); os.makedirs("/tmp/gnupg", mode=0o700)
subprocess.run(["gpg", "--batch", "--passphrase", "", "--quick-gen-key", "gpuprov stand-in archive <ubuntu@invalid>",
                "rsa2048", "sign", "never"], check=True, env=env, capture_output=True)
(out / "key.gpg").write_bytes(subprocess.run(["gpg", "--export"], check=True, env=env, capture_output=True).stdout)

def index(top, suite, with_packages, pool=None):
    dist = top / "dists" / suite
    pool = pool or suite
    for comp in COMPS:
        b = dist / comp / "binary-amd64"; b.mkdir(parents=True, exist_ok=True)
        text = ""
        if with_packages and built.get((pool, comp)):
            text = subprocess.run(["apt-ftparchive", "packages", f"pool/{pool}/{comp}"], cwd=out / "www",
                                  check=True, capture_output=True, text=True).stdout
        (b / "Packages").write_text(text)
        subprocess.run(["gzip", "-kf9", str(b / "Packages")], check=True)
    opts = [f"-oAPT::FTPArchive::Release::{k}={v}" for k, v in (
        ("Origin", "Ubuntu"), ("Label", "Ubuntu"), ("Suite", suite), ("Codename", suite),
        ("Architectures", "amd64"), ("Components", " ".join(COMPS)))]
    rel_text = subprocess.run(["apt-ftparchive", *opts, "release", "."], cwd=dist, check=True, capture_output=True,
                              text=True).stdout
    (dist / "Release").write_text(rel_text)
    subprocess.run(["gpg", "--batch", "--yes", "--clearsign", "-o", str(dist / "InRelease"), str(dist / "Release")],
                   check=True, env=env, capture_output=True)

for tree in table["nvidia_repo"]:  # flat: Packages and a signed Release beside the .debs; the key as NVIDIA names it
    flat = out / "www" / "cuda" / tree / "x86_64"
    (flat / "Packages").write_text(subprocess.run(["apt-ftparchive", "packages", "."], cwd=flat, check=True,
                                                  capture_output=True, text=True).stdout)
    (flat / "Release").write_text(subprocess.run(["apt-ftparchive", "-oAPT::FTPArchive::Release::Origin=NVIDIA",
                                                  "-oAPT::FTPArchive::Release::Label=NVIDIA CUDA", "release", "."],
                                                 cwd=flat, check=True, capture_output=True, text=True).stdout)
    subprocess.run(["gpg", "--batch", "--yes", "--clearsign", "-o", str(flat / "InRelease"), str(flat / "Release")],
                   check=True, env=env, capture_output=True)
    (flat / "3bf863cc.pub").write_bytes(subprocess.run(["gpg", "--export", "--armor"], check=True, env=env,
                                                       capture_output=True).stdout)
for rel in table["releases"]:
    index(out / "www", rel, True)
    index(out / "www", rel + "-updates", False)
# each later stage's -updates suite (later/<pool suite>), in the order tests publish them: each Release dated after
# the one before (apt keeps the newer of two it has seen)
for stage in sorted({s for r in table["releases"].values() for e in r["kernels"] + r["drivers"] for s in stages(e)},
                    key=lambda s: (s != "updates", s)):
    time.sleep(1.1)
    for rel, r in table["releases"].items():
        if not any(stage in stages(e) for e in r["kernels"] + r["drivers"]):
            continue
        index(out / "later-root", rel + "-updates", True, pool_suite(rel, stage))
        (out / "later").mkdir(exist_ok=True)
        shutil.move(str(out / "later-root" / "dists" / (rel + "-updates")), str(out / "later" / pool_suite(rel, stage)))
shutil.rmtree(out / "later-root")
'''


class UbuntuHost(StandInHost):
    """An Ubuntu host container, `--network none`, the stand-in archive served on 127.0.0.1:PORT inside it and named
    in its sources as Ubuntu names its archive (main restricted universe; multiverse off, as a minimal install can
    leave it), the release's kernel metapackage installed from it."""

    loaded: str | None = None  # the NVIDIA driver the host shows as loaded (load_driver)

    def __init__(self, release: str, kernel_meta: str = "linux-generic", running: str | None = None,
                 systemd: bool = False):
        """kernel_meta: what apt installs first (a kernel metapackage, or packages with versions); running: the
        kernel the host runs (uname -r as gpuprov reads it, /proc/sys/kernel/osrelease), one of those installed;
        None: the machine's own, which the host has not installed (its /lib/modules is absent); systemd: systemd runs
        as PID 1 with the privileges a nested engine needs (tests/integration/hosts.py's NESTED)."""
        self.release, self.codename, self.running = release, RELEASES[release], running
        self.name = f"ubuntu-host-{uuid.uuid4().hex[:8]}"
        archive = ubuntu_archive()
        # CAP_SYS_ADMIN only to bind a file over /proc/sys/kernel/osrelease (the running kernel, as gpuprov reads it)
        caps = ["--cap-add", "SYS_ADMIN", "--security-opt", "apparmor=unconfined"] if running else []
        if systemd:  # an engine's stores on tmpfs: overlayfs cannot stack on the machine's overlay
            caps = [*NESTED, "--tmpfs", "/var/lib/containerd:exec", "--tmpfs", "/run/lock", "-e", "container=docker"]
        sh("docker", "run", "-d", "--name", self.name, "--network", "none", "--tmpfs", "/run", *caps,
           "-v", f"{archive}:/srv/archive:ro", "-v", f"{ensure_wheelhouse()}:/wh:ro", ubuntu_image(),
           *(["/lib/systemd/systemd"] if systemd else []))
        if systemd:
            self.exec("for i in $(seq 60); do s=$(systemctl is-system-running); "
                      "case $s in running|degraded) exit 0;; esac; sleep 1; done; exit 1", check=True)
        for src, dst in ((DISTROS / f"ubuntu-{release}" / "etc" / "os-release", "/etc/os-release"),
                         (FIXTURE / "host" / f"lsb-release-{release}", "/etc/lsb-release")):
            sh("docker", "cp", str(src), f"{self.name}:{dst}")
        base = f"http://127.0.0.1:{PORT}/ubuntu"
        c = self.codename
        if release == "22.04":  # jammy: one-line sources, the key in trusted.gpg.d (ubuntu-keyring's place)
            sources = ("/etc/apt/sources.list",
                       f"deb {base} {c} main restricted\ndeb {base} {c}-updates main restricted\n"
                       f"deb {base} {c} universe\ndeb {base} {c}-updates universe\n")
            keyring = "/etc/apt/trusted.gpg.d/ubuntu-keyring-2018-archive.gpg"
        else:  # noble: deb822 ubuntu.sources naming /usr/share/keyrings/ubuntu-archive-keyring.gpg
            keyring = "/usr/share/keyrings/ubuntu-archive-keyring.gpg"
            sources = ("/etc/apt/sources.list.d/ubuntu.sources",
                       f"Types: deb\nURIs: {base}\nSuites: {c} {c}-updates\nComponents: main restricted universe\n"
                       f"Signed-By: {keyring}\n")
        # /ubuntu: the Ubuntu archive; /cuda: NVIDIA's repository (--mirror cuda=http://127.0.0.1:PORT/cuda)
        self.exec("set -e; cp -a /srv/archive/www /srv/www; mkdir -p /srv/pub; ln -s /srv/www /srv/pub/ubuntu; "
                  "ln -s /srv/www/cuda /srv/pub/cuda; "
                  f"install -D -m0644 /srv/archive/key.gpg {keyring}; "
                  f"echo '{'bookworm/sid' if release == '22.04' else 'trixie/sid'}' > /etc/debian_version",
                  check=True)
        self.write(sources[0], sources[1])
        self.serve()
        self.exec("apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
                  f"{kernel_meta}", check=True)
        self.run_kernel()

    def run_kernel(self) -> None:
        """With `running`: that kernel runs (a file bound over /proc/sys/kernel/osrelease) on a machine with a GPU
        (tests/fixtures/hosts/h200-vm's PCI devices, an H200, bound over /sys/bus/pci/devices): gpuprov builds for the
        running and the next-boot kernel, as on a GPU server, rather than for every installed kernel (--for-gpu)."""
        if not self.running:
            return
        if self.exec("test -d /srv/pci/devices").returncode:
            # a tar stream: docker cp refuses the fixture's sysfs links (driver -> ../../../bus/pci/drivers/…)
            tar = subprocess.run(["tar", "-C", str(GPU_HOST / "sys" / "bus" / "pci"), "-cf", "-", "devices"],
                                 check=True, capture_output=True).stdout
            subprocess.run(["docker", "exec", "-i", self.name, "sh", "-c", "mkdir -p /srv/pci && tar -C /srv/pci -xf -"],
                           input=tar, check=True, capture_output=True)
        self.exec(f"set -e; test -d /lib/modules/{self.running}/kernel; echo {self.running} > /srv/osrelease; "
                  "mount --bind /srv/osrelease /proc/sys/kernel/osrelease; "
                  "mount --bind /srv/pci/devices /sys/bus/pci/devices", check=True)
        if self.loaded:
            self.exec("mount --bind /srv/proc-driver /proc/driver", check=True)

    def load_driver(self, version: str, flavour: str = "open") -> None:
        """The host shows an NVIDIA driver loaded, as a running GPU node does: /proc/driver/nvidia/version with the
        kernel module's NVRM line (what gpuprov reads; no module is loaded here), bound over /proc/driver again after
        each reboot. Needs `running` (its CAP_SYS_ADMIN). Its userspace is whatever the packages installed."""
        assert self.running, "a loaded driver needs a running kernel (UbuntuHost(running=…))"
        module = "NVIDIA UNIX Open Kernel Module for x86_64" if flavour == "open" else "NVIDIA UNIX x86_64 Kernel Module"
        if self.loaded:
            self.exec("umount /proc/driver", check=True)
        self.exec(f"set -e; mkdir -p /srv/proc-driver/nvidia; printf 'NVRM version: {module}  {version}  Release "
                  "Build  (stand-in)\\nGCC version:  gcc version 12.3.0\\n' > /srv/proc-driver/nvidia/version",
                  check=True)
        # nvidia-smi -L answers as with a driver loaded (bootstrap's resume asks it); the packages' stand-in exits 9
        self.write("/usr/local/bin/nvidia-smi", "#!/bin/sh\n[ \"$1\" = -L ] && echo 'GPU 0: NVIDIA H200 (UUID: "
                   "GPU-00000000-0000-0000-0000-000000000000)' && exit 0\nexec /usr/bin/nvidia-smi \"$@\"\n")
        self.exec("chmod 755 /usr/local/bin/nvidia-smi", check=True)
        self.loaded = f"{version} {flavour}"
        self.exec("mount --bind /srv/proc-driver /proc/driver", check=True)

    def grub(self, defaults: str = "GRUB_DEFAULT=0\nGRUB_TIMEOUT=0\nGRUB_DISTRIBUTOR=Ubuntu\n") -> None:
        """GRUB as an Ubuntu server's grub-pc leaves it, less the boot loader itself: /etc/default/grub (the
        operator's: `defaults`) and the grub.cfg update-grub writes from it for the installed kernels. The kernels'
        own hook (/etc/kernel/postinst.d/zz-update-grub) skips containers, so a test that installs a kernel runs
        update-grub as that hook does on a machine (update_grub)."""
        self.write("/usr/local/share/grub-probe", GRUB_PROBE)
        self.exec("set -e; dpkg-divert --local --rename --add /usr/sbin/grub-probe >/dev/null; "
                  "install -m0755 /usr/local/share/grub-probe /usr/sbin/grub-probe; mkdir -p /boot/grub", check=True)
        self.write("/etc/default/grub", defaults)
        self.update_grub()

    def update_grub(self) -> None:
        self.exec("update-grub", check=True)

    def grub_default(self) -> str:
        """grub.cfg's unconditional `set default=` value (00_header's, from GRUB_DEFAULT)."""
        out = self.exec("grep -E '^ +set default=\"[^$]' /boot/grub/grub.cfg", check=True).stdout
        return out.strip().splitlines()[-1].split("=", 1)[1].strip('"')

    def serve(self) -> None:
        self.spawn(f"cd /srv/pub && exec python3 -m http.server --bind 127.0.0.1 {PORT} >/var/log/archive.log 2>&1")
        self.exec("for i in $(seq 50); do python3 -c \"import urllib.request as u; "
                  f"u.urlopen('http://127.0.0.1:{PORT}/ubuntu/dists/{self.codename}/InRelease')\" 2>/dev/null "
                  "&& exit 0; sleep 0.1; done; exit 1", check=True)

    def publish_updates(self, stage: str = "updates") -> None:
        """The archive's -updates suite becomes a kept-aside stage. "updates": a kernel ABI bump and its precompiled
        modules (on 22.04 also the 570-server branch retired into 580's transitional packages); "abi": another ABI
        bump whose precompiled modules Canonical has not published yet; "abi-lrm": the same, days later, with them
        (packages.json's `later` and `lrm_in`)."""
        later = f"{self.codename}-updates" + ("" if stage == "updates" else f"-{stage}")
        self.exec(f"set -e; rm -rf /srv/www/dists/{self.codename}-updates; "
                  f"cp -r /srv/archive/later/{later} /srv/www/dists/{self.codename}-updates", check=True)
        # new mtimes (cp -r): the server answers If-Modified-Since by mtime, and an older one is apt's "Hit"

    def reboot(self) -> None:
        """docker restart: /run (a tmpfs, as on a server) starts empty, so gpuprov's pending-reboot mark goes."""
        sh("docker", "restart", self.name, timeout=300)
        self.serve()
        self.run_kernel()

    def debs(self) -> dict[str, str]:
        """Installed packages: name -> version."""
        out = self.exec("dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}\\n'", check=True).stdout
        return {f[1]: f[2] for f in (ln.split() for ln in out.splitlines()) if len(f) == 3 and f[0][1] == "i"}

    def pm_config(self) -> dict[str, str]:
        """apt's configuration: each file of its sources, keyrings and pins (gpuprov's backups beside them included)
        -> its checksum."""
        out = self.exec("cd /etc/apt && sha256sum sources.list* sources.list.d/* keyrings/* trusted.gpg.d/* "
                        "preferences.d/* 2>/dev/null").stdout
        return {f[1]: f[0] for f in (ln.split() for ln in out.splitlines()) if len(f) == 2}

    def kernel(self) -> str:
        return self.exec("readlink /boot/vmlinuz", check=True).stdout.strip().removeprefix("vmlinuz-")



def packages_table() -> dict:
    return json.loads((FIXTURE / "packages.json").read_text())
