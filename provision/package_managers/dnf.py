"""dnf, and yum on EL 7, as gpuprov's package-manager adapter (provision/package_managers/base.py).

The install record keeps every package a step's transactions added to rpm's database, dependencies included
(`records_dependencies`): dnf's `remove` takes unused dependencies along (clean_requirements_on_remove, on by default
on EL), so a record of the named packages alone would let a purge remove dependencies the record does not name, or
(with that option off) leave gpuprov's dependencies behind. With the dependencies recorded, the purge names exactly
what gpuprov installed and runs with that option off, so what else it would remove is only what depends on them (a
package the operator installed since), which its dry run names.

Holds are dnf's versionlock: the named packages and every installed nvidia package of their version (ELRepo's
kmod-nvidia-open, nvidia-x11-drv and nvidia-x11-drv-libs; the CUDA repository's nvidia-driver-*). With the kmod alone
locked, `dnf upgrade` meets the next nvidia-x11-drv, which needs the next kmod, and (best=True, EL's default) fails
whole, kernel updates included (tests/integration/test_el_dnf.py). Their earlier locks (another branch's, before a
module stream switch) are deleted first: two entries of one name would let dnf take either version."""
from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Callable

from provision import effects
from provision.errors import StepFailed
from provision.facts.packages import InstalledPackage, UnfinishedPackage
from provision.facts.rootfs import is_live, read_text, under
from provision.facts.rpm_unfinished import (
    CUT,
    NEWEST,
    OLDER,
    ROW_FORMAT,
    cut_transaction,
    dnf_running,
    duplicated_names,
    installonly_extra,
    rpm_duplicates,
    rpm_rows,
)
from provision.fsutil import write_file
from provision.package_managers.base import Answer, Argv, HoldWords, PackageManager
from provision.record import entry_names

# rpm lists each imported signing key as a `gpg-pubkey` package: a key is trust the repository's step set up, not a
# package of gpuprov's to purge (and every key has that one name).
NOT_PACKAGES = ("gpg-pubkey",)
# dnf's default installonlypkgs: packages installed side by side in several versions (every kernel's kernel-devel
# beside the others). The record keeps those by NAME-VERSION-RELEASE.ARCH: by name, a purge of the kernel-devel gpuprov
# installed would take the operator's kernel-devel of another kernel along, and its dry run could not tell them apart.
INSTALLONLY = ("kernel", "kernel-PAE", "installonlypkg(kernel)", "installonlypkg(kernel-module)",
               "installonlypkg(vm)", "multiversion(kernel)")
# Only the named packages and what depends on them: never dependencies dnf finds unused (see the module's text).
NO_AUTOREMOVE = "--setopt=clean_requirements_on_remove=0"
LOCK_ENTRY = re.compile(r"^!?(?:\d+:)?(.+?)-(?:\d+:)?([^-]+)-[^-]+$")  # [!]NAME-[EPOCH:]VERSION-RELEASE.ARCH
# dnf 4 / yum: "Removing:", "Removing dependent packages:", "Removing for dependencies:", "Erasing:"; dnf 5:
# "Removing:", "Removing dependent packages:". Obsoleted packages show as "replacing  NAME.ARCH VERSION" lines.
REMOVE_SECTION = re.compile(r"^(Removing|Erasing)\b[^:]*:\s*$")
LOCK_SERIES = ("pm=$1; shift; v=$(rpm -q --qf '%{VERSION}\\n' \"$@\" | sort -u); "
               "[ $(printf '%s\\n' \"$v\" | wc -l) = 1 ] || { echo \"driver packages at several versions: $v\" >&2; "
               "exit 1; }; n=$({ printf '%s\\n' \"$@\"; rpm -qa --qf '%{NAME} %{VERSION}\\n' | "
               "awk -v v=\"$v\" '$1 ~ /nvidia/ && $2 == v {print $1}'; } | sort -u); "
               "\"$pm\" versionlock delete $n >/dev/null; exec \"$pm\" versionlock add $n")
MODULES_D = "/etc/dnf/modules.d"
LOCK_HOLDERS = ("dnf", "yum")  # what holds dnf's rpmdb lock: dnf, dnf-automatic, and EL 8+'s yum (which is dnf)
RPM_DBPATHS = ("var/lib/rpm", "usr/lib/sysimage/rpm")  # rpm's database: EL 8/9's place, and Fedora's/EL 10's
KEY_ROW = "%{NAME}-%{VERSION}-%{RELEASE}\n"  # an imported key as `rpm -e` takes it
RPM_ROW = "%{NAME} %{EPOCHNUM}:%{VERSION}-%{RELEASE}\n"  # installed_packages' query: one package a line
# NVIDIA's `nvidia-driver` module: a stream's kernel-module flavour is in its name (570-open and open-dkms: open;
# 570-dkms and latest-dkms: proprietary), and each flavour's kmod package conflicts with the other's, so a switch
# between flavours replaces one with the other (NVIDIA's guide: `dnf module switch-to nvidia-driver:S --allowerasing`).
DRIVER_MODULE = "nvidia-driver"
FLAVOUR_KMOD = {"open": "kmod-nvidia-open-dkms", "proprietary": "kmod-nvidia-latest-dkms"}


def stream_flavour(stream: str) -> str:
    return "open" if stream.endswith("-open") or stream == "open-dkms" else "proprietary"


def _read(root: Path, path: str) -> str:
    return read_text(root, path) or ""


def _pairs(argv: list[str]) -> dict[str, str]:
    """An rpm query whose format prints two fields a line (`%{NAME} %{VERSION}` …) as a dict: first -> second."""
    res = effects.try_run(argv, timeout=60, probe=True)
    return dict(ln.split(" ", 1) for ln in (res.output if res else "").splitlines() if ln.count(" ") == 1)


# The preflight (provision/plan/preflight.py): the scratch root's repository directory, the host's (dnf's default
# reposdir), and dnf's words (LC_ALL=C) for a repository it could not read and for a spec nothing matches.
SCRATCH_REPOS = "/etc/yum.repos.d"
DNF_CONF = "/etc/dnf/dnf.conf"
HOST_REPOS = ("/etc/yum.repos.d", "/etc/yum/repos.d", "/etc/distro.repos.d")
UNREACHABLE = re.compile(r"^.*(?:Failed to download metadata for repo|Cannot download repomd\.xml|"
                         r"Curl error \(\d+\)|Cannot retrieve repository metadata).*$", re.M)
NO_MATCH = re.compile(r"^No match for argument: (.+)$", re.M)


class Dnf(PackageManager):
    name = "dnf"
    database = "rpm"
    records_dependencies = True
    module_streams = True
    recoverable = True
    hold_needs: Argv = ("python3-dnf-plugin-versionlock",)
    lock_list = "/etc/dnf/plugins/versionlock.list"

    # ------------------------------------------------------------ install

    def refresh(self, opts: Argv = ()) -> None:
        return None  # dnf refreshes expired metadata itself

    def upgrade_verb(self) -> Argv:
        return ("upgrade",)

    def unlocked(self) -> Argv:
        return ("--disableplugin=versionlock",)

    def offered(self, package: str) -> Argv:
        """Installed or available, at any version (versionlock would hide the versions it does not hold)."""
        return (self.name, "--disableplugin=versionlock", "-q", "list", "--showduplicates", package)

    def simulate_install(self, packages: Argv, opts: Argv = (), verb: Argv = ("install",), remove: Argv = ()) -> Argv:
        """`remove`: what the transaction replaces on purpose (a flavour switch's old kmod, `stream_swaps`): dnf
        erases it only with --allowerasing, its dry run too (without, the dry run fails on the conflict)."""
        return (self.name, *opts, *verb, "--assumeno", *(self._erasing(True) if remove else ()), *packages)

    def install(self, packages: Argv, opts: Argv = (), verb: Argv = ("install",), allow_remove: bool = False,
                remove: Argv = ()) -> Argv:
        return (self.name, *opts, *verb, "-y", *self._erasing(allow_remove or bool(remove)), *packages)

    def _erasing(self, allow_remove: bool) -> Argv:
        """dnf erases nothing without --allowerasing."""
        return ("--allowerasing",) if allow_remove else ()

    def stream_install(self, spec: str, opts: Argv = (), switch: bool = False) -> tuple[Argv, Argv]:
        """(opts, verb) of a module stream's install: a stream switch (a branch change) runs, dry run included,
        without the versionlock plugin: the old branch's locks are gpuprov's own, and the hold replaces them."""
        return ((*opts, *self.unlocked()) if switch else opts,
                ("module", "switch-to" if switch else "install"))

    def removals(self, output: str) -> list[str]:
        found, in_section, wrapped = [], False, False
        for line in output.splitlines():
            words = line.split()
            if REMOVE_SECTION.match(line):
                in_section = True
            elif not line.startswith(" ") or not words:
                in_section = False  # another section header, the summary, or the blank line after a table
            elif wrapped:
                pass  # the rest of a row whose name filled the column (arch, version, repository, size)
            elif words[0] == "replacing" and len(words) > 1:
                found.append(words[1].rsplit(".", 1)[0])
            elif in_section:
                found.append(words[0])
            # dnf puts a name wider than its column on a line of its own and the row's other fields on the next
            # (`python3-dnf-plugin-versionlock` beside an `@commandline` package): that next line names no package
            wrapped = in_section and len(words) == 1 and line.startswith(" ")
        return list(dict.fromkeys(found))

    # ------------------------------------------------------------ what is installed

    def versions(self) -> dict[str, str]:
        return _pairs(["rpm", "-qa", "--qf", "%{NAME} %{VERSION}-%{RELEASE}\n"])

    def snapshot(self) -> dict[str, str]:
        """Every installed package as NAME-VERSION-RELEASE.ARCH -> NAME (one query): what a step added, kernels'
        side-by-side versions apart."""
        return _pairs(["rpm", "-qa", "--qf", "%{NAME}-%{VERSION}-%{RELEASE}.%{ARCH} %{NAME}\n"])

    def installonly(self, root: Path | None = None) -> set[str]:
        """The installed packages' names that dnf installs side by side (INSTALLONLY, as rpm answers for them; under
        `root`, with what its dnf.conf adds)."""
        where = ("--root", str(root)) if root is not None else ()
        extra = installonly_extra(root) if root is not None else ()
        res = effects.try_run(["rpm", *where, "-q", "--qf", "%{NAME}\n", "--whatprovides", *INSTALLONLY, *extra],
                              timeout=60, probe=True)
        return {ln.strip() for ln in (res.output if res else "").splitlines()
                if ln.strip() and " " not in ln.strip()}  # "no package provides …" lines have spaces

    def added(self, before: dict[str, str], after: dict[str, str]) -> list[str]:
        """What the install record keeps of a step's transactions (snapshots before and after): each package name
        new to rpm's database, and, for the packages installed side by side, each new NAME-VERSION-RELEASE.ARCH
        (the very version gpuprov installed, whatever the operator installs of that name later)."""
        names_before = set(before.values())
        only = self.installonly() if any(n not in before for n in after) else set()
        out = []
        for nevra, name in after.items():
            if nevra in before or name in NOT_PACKAGES:
                continue
            if name in only:
                out.append(nevra)
            elif name not in names_before:
                out.append(name)
        return list(dict.fromkeys(out))

    def installed(self, packages: Argv, root: Path) -> bool:
        """By name or NEVRA (kernel-devel-K.x86_64), else by what provides it (a module spec: its name)."""
        if not packages:
            return True
        argv = ["rpm", "--root", str(root), "-q", *[p.split(":")[0] for p in packages]]
        try:
            p = effects.run(argv, check=False, probe=True)
            if p.returncode != 0:
                argv[3:] = ["-q", "--whatprovides",
                            *[n for n in argv[4:] if f"package {n} is not installed" in p.output]]
                p = effects.run(argv, check=False, probe=True)
        except StepFailed:  # rpm itself is missing under this root: nothing is installed by it
            return False
        return p.returncode == 0

    def installed_packages(self, root: Path, match: Callable[[str], object]) -> dict[str, InstalledPackage]:
        """rpm's database under `root`, asked (`rpm --root ROOT -qa`) rather than read: its file is rpm's own format
        (sqlite on EL 9 and Amazon Linux 2023, Berkeley DB on EL 8 and Alibaba Cloud Linux 3), which only rpm reads
        on every release. A query changes nothing. Versions as [EPOCH:]VERSION-RELEASE (epoch 0 left out). A root
        without rpm's database (a host tree of another family, a fixture) is not asked: a plan runs no command there
        (tests/unit/test_plan_truth.py)."""
        if not any(under(root, d).is_dir() for d in RPM_DBPATHS):
            return {}
        res = effects.try_run(["rpm", "--root", str(root), "-qa", "--qf", RPM_ROW], timeout=60, probe=True)
        out = {}
        for line in (res.output if res and res.returncode == 0 else "").splitlines():
            name, _, version = line.partition(" ")
            if version and " " not in version and match(name):
                out[name] = InstalledPackage(name, version.removeprefix("0:"), database="rpm")
        return out

    def rpm_versions(self, root: Path, names: Argv) -> dict[str, str]:
        """The installed VERSION of each of `names` that rpm's database under `root` lists."""
        return _pairs(["rpm", "--root", str(root), "-q", "--qf", "%{NAME} %{VERSION}\n", *names])

    # ------------------------------------------------------------ holds: the versionlock list

    def hold(self, packages: Argv) -> tuple[Argv, ...]:
        return (("sh", "-c", LOCK_SERIES, "lock-series", self.name, *packages),)

    def hold_words(self, packages: Argv) -> HoldWords:
        """A userspace upgrade under a loaded module is "Driver/library version mismatch" until the reboot: the
        packages stay locked until the operator upgrades them on purpose."""
        return HoldWords(f"Hold the driver packages against upgrades: {' '.join(packages)}, and every installed "
                         "nvidia package of their version",
                         (f"upgrade the driver on purpose: `{self.name} versionlock delete …`, upgrade, reboot",),
                         f"skipped when {' '.join(packages)} are held")

    def locks(self, root: Path) -> list[tuple[str, str]]:
        """(name, version) of each entry of the versionlock list under `root`, in order."""
        out = []
        for line in _read(root, self.lock_list).splitlines():
            m = LOCK_ENTRY.match(line.strip())
            if m and not line.lstrip().startswith("#"):
                out.append((m.group(1), m.group(2)))
        return out

    def locked_names(self, root: Path) -> list[str]:
        return list(dict.fromkeys(n for n, _ in self.locks(root)))

    def held(self, root: Path, packages: Argv) -> bool:
        """Each of `packages` is locked, and only at the version installed (after a stream switch the old branch's
        lock would keep the new packages from their updates within the branch, and hold nothing)."""
        have = self.locks(root)
        if not all(any(n == name for n, _ in have) for name in packages):
            return False  # read from the list alone: no rpm query (a plan on a host gpuprov never locked runs none)
        installed = self.rpm_versions(root, packages)
        return all(any(n == name for n, _ in have) and all(v == installed.get(name) for n, v in have if n == name)
                   for name in packages)

    def unhold(self, names: Argv) -> Argv:
        return (self.name, "versionlock", "delete", *names)

    # ------------------------------------------------------------ module streams

    def enabled_streams(self, root: Path) -> dict[str, str]:
        """The module streams dnf has enabled under `root` (its /etc/dnf/modules.d/NAME.module state files)."""
        out = {}
        d = under(root, MODULES_D)
        for f in sorted(d.glob("*.module")) if d.is_dir() else ():
            text = _read(root, f"{MODULES_D}/{f.name}")
            state = re.search(r"^state\s*=\s*(\S+)", text, re.M)
            stream = re.search(r"^stream\s*=\s*(\S+)", text, re.M)
            if state and state.group(1) == "enabled" and stream:
                out[f.name[:-len(".module")]] = stream.group(1)
        return out

    def streams_to_switch(self, root: Path, specs: Argv) -> Argv:
        """The `NAME:STREAM` specs whose module has another stream enabled: a branch change, `module switch-to`."""
        on = self.enabled_streams(root)
        return tuple(s for s in specs if ":" in s and on.get(s.split(":")[0]) not in (None, s.split(":")[1]))

    def stream_swaps(self, root: Path, switch: Argv) -> Argv:
        """The installed kmod packages of the other kernel-module flavour that switching to the `switch` streams
        replaces: that one removal is the switch's own (in its transaction, beside the new flavour's kmod); its dry
        run refuses any other."""
        on = self.enabled_streams(root)
        old = [FLAVOUR_KMOD[stream_flavour(on[m])] for m, _, new in (s.partition(":") for s in switch)
               if m == DRIVER_MODULE and m in on and stream_flavour(on[m]) != stream_flavour(new)]
        return tuple(self.rpm_versions(root, tuple(old))) if old else ()

    def stream_resets(self, root: Path, recorded: Argv) -> Argv:
        """The modules of the install record's `streams` (those gpuprov enabled where none was) that still have a
        stream enabled: `uninstall --purge-driver` resets them after the purge. An operator's own enabled stream is
        never recorded."""
        on = self.enabled_streams(root)
        return tuple(m for m in recorded if m in on)

    def reset_streams(self, modules: Argv) -> Argv:
        return (self.name, "module", "reset", "-y", *modules)

    # ------------------------------------------------------------ purge

    def simulate_purge(self, packages: Argv) -> Argv:
        return (self.name, "remove", "--assumeno", NO_AUTOREMOVE, *packages)

    def purge(self, packages: Argv) -> Argv:
        return (self.name, "remove", "-y", NO_AUTOREMOVE, *packages)

    def removal_hint(self, root: Path, packages: Argv) -> tuple[Argv, ...]:
        """dnf's remove, and where NVIDIA's `nvidia-driver` module has a stream enabled, its reset: an enabled stream
        stays enabled after its packages go, and dnf would offer only that stream's packages of those names."""
        reset = ((self.name, "module", "reset", DRIVER_MODULE),) \
            if self.module_streams and DRIVER_MODULE in self.enabled_streams(root) else ()
        return ((self.name, "remove", *packages), *reset)

    def purge_dry_run_ok(self, returncode: int, output: str) -> bool:
        """dnf answers `--assumeno` with its transaction and "Operation aborted." (yum: "Exiting on user command"),
        exit 1; any other failure is the package manager's own (a package it cannot find)."""
        return returncode == 0 or any(w in output for w in ("Operation aborted", "Exiting on user command"))

    def purged_too(self, output: str, packages: Argv) -> list[str]:
        """dnf's dry run names packages by NAME; a recorded NAME-VERSION-RELEASE.ARCH (a kernel's side-by-side
        package) is that name: the purge names that version alone, so the name in the dry run is it."""
        return sorted(n for n in set(self.removals(output)) if not any(entry_names(p, n) for p in packages))

    def holds_among(self, root: Path, holds: Argv, packages: Argv) -> Argv:
        """`versionlock delete` matches by name: the locked names among the holds and the packages, in the list's
        order (gpuprov's lock covers every nvidia package of the driver's version, recorded with the transaction)."""
        return tuple(n for n in self.locked_names(root) if n in {*holds, *packages})

    def holds_others(self, root: Path, names: set[str]) -> bool:
        return any(n not in names for n in self.locked_names(root))

    # ------------------------------------------------------------ a killed run (issue 44; facts/rpm_unfinished.py)

    def unfinished(self, root: Path) -> list[UnfinishedPackage]:
        """What a killed dnf run left under `root`: each name-arch rpm lists twice (the older header beside the newer,
        whose %post may have been cut off), and the packages the last transaction in dnf's history brought in, where
        it never ended (their %post or %posttrans may not have run). Nothing while a dnf holds its lock (a
        transaction under way is not a killed one), nor where rpm's database is not there (no command then)."""
        if not any(under(root, d).is_dir() for d in RPM_DBPATHS) or dnf_running(root, LOCK_HOLDERS):
            return []
        res = effects.try_run(["rpm", "--root", str(root), "-qa", "--qf", ROW_FORMAT], timeout=60, probe=True)
        rows = rpm_rows(res.output if res and res.returncode == 0 else "")
        out = rpm_duplicates(rows, self.installonly(root) if duplicated_names(rows) else set())
        taken, have = {(u.name, u.architecture) for u in out}, set(rows)
        return out + [UnfinishedPackage(r.name, r.evr, r.arch, CUT, True, "rpm") for r in cut_transaction(root)
                      if r in have and (r.name, r.arch) not in taken]

    def unfetchable(self, root: Path, packages: list[UnfinishedPackage]) -> list[UnfinishedPackage]:
        """Asks dnf itself (`repoquery --available` of the exact versions, the versionlock plugin off as in the
        recovery): from its cached metadata first (a plan fetches nothing when that has them all), then, for a
        version it lacks there or where there is none, from metadata dnf fetches anew (a cache from before the
        repository got that version back must not stop the run). Where dnf cannot answer at all (no repository
        reachable, no cache), none is said unfetchable: the recovery's own dnf run then fails with dnf's reason."""
        if not packages:
            return []
        where = () if is_live(root) else ("--installroot", str(root))
        query = ("repoquery", "--available", "--qf", "%{name}-%{epoch}:%{version}-%{release}.%{arch}",
                 *(u.spec for u in packages))
        missing: list[UnfinishedPackage] = []
        for cache in ("--cacheonly", "--refresh"):
            res = effects.try_run([self.name, "-q", cache, *where, *self.unlocked(), *query], timeout=300, probe=True)
            if res and res.returncode == 0:
                found = {ln.strip() for ln in res.output.splitlines()}
                missing = [u for u in packages if u.spec not in found]
                if not missing:
                    break
        return missing

    def refetch_hint(self, names: Argv) -> str:
        return ("make that version available to dnf again (a repository that has it, or its .rpm: `dnf reinstall "
                "./FILE.rpm`, after `dnf remove --duplicates` where rpm lists it twice), or take the repositories' "
                f"version with `dnf remove --duplicates` and `dnf distro-sync {' '.join(names)}`")

    def recover(self, allow_remove: bool, unfinished: list[UnfinishedPackage]) -> tuple[Argv, ...]:
        """dnf's own ways out: `remove --duplicates` removes the older header of each duplicated name-arch and
        reinstalls the newest (its %pre, files, %post and %posttrans run whole); `reinstall` of the exact versions a
        cut-off transaction brought in runs their scriptlets again. The versionlock plugin is off: these are the very
        versions installed, which a lock (gpuprov's hold, or the operator's) must not hide. No dependency is taken
        along with an older duplicate (clean_requirements_on_remove off); one that needs the older version stops the
        recovery (`recover_dry_run`)."""
        out: list[Argv] = []
        if any(u.state == OLDER for u in unfinished):
            out.append((self.name, *self.unlocked(), NO_AUTOREMOVE, "remove", "--duplicates", "-y"))
        again = tuple(u.spec for u in unfinished if u.state == CUT)
        if again:
            out.append((self.name, *self.unlocked(), "reinstall", "-y", *again))
        return tuple(out)

    def recover_dry_run(self, unfinished: list[UnfinishedPackage]) -> Argv | None:
        """`remove --duplicates` removes what depends on an older duplicate where dnf finds nothing else to do with
        it: its dry run first, which must remove nothing but the older duplicates (dnf shows each as `replacing`)."""
        return (self.name, *self.unlocked(), NO_AUTOREMOVE, "remove", "--duplicates", "--assumeno") \
            if any(u.state == OLDER for u in unfinished) else None

    def recover_removes(self, unfinished: list[UnfinishedPackage]) -> Argv:
        return tuple(dict.fromkeys(u.name for u in unfinished if u.state == OLDER))

    def recover_what(self, unfinished: list[UnfinishedPackage]) -> str:
        parts = []
        for new in (u for u in unfinished if u.state == NEWEST):
            older = [u.spec for u in unfinished if u.state == OLDER and (u.name, u.architecture) ==
                     (new.name, new.architecture)]
            parts.append(f"remove the second header of {new.spec} (a killed reinstall) and reinstall it"
                         if set(older) == {new.spec} else
                         f"remove the older duplicate {', '.join(older)} and reinstall {new.spec}")
        cut = [u.spec for u in unfinished if u.state == CUT]
        if cut:
            parts.append(f"reinstall {', '.join(cut)} (its transaction was cut off)")
        return "; ".join(parts)

    # ------------------------------------------------------------ repositories, keys and bundles

    leftover_suffixes = (".rpmsave", ".rpmnew", ".rpmorig")
    purge_leaves = (".rpmsave",)  # rpm keeps a changed config file of an erased package as NAME.rpmsave

    @property
    def config_globs(self) -> Argv:  # type: ignore[override]
        return ("/etc/yum.repos.d/*", "/etc/pki/rpm-gpg/*", self.lock_list)

    def imported_keys(self, root: Path) -> set[str]:
        """rpm lists each imported key as gpg-pubkey-VERSION-RELEASE (VERSION: the key id)."""
        if not any(under(root, d).is_dir() for d in RPM_DBPATHS):
            return set()
        res = effects.try_run(["rpm", "--root", str(root), "-q", "gpg-pubkey", "--qf", KEY_ROW], timeout=60,
                              probe=True)
        return {ln.strip() for ln in (res.output if res and res.returncode == 0 else "").splitlines()
                if ln.startswith("gpg-pubkey-")}

    def forget_keys(self, keys: Argv) -> Argv:
        return ("rpm", "-e", *keys)

    def owners(self, root: Path, path: str) -> set[str]:
        if not any(under(root, d).is_dir() for d in RPM_DBPATHS):
            return set()
        res = effects.try_run(["rpm", "--root", str(root), "-qf", "--qf", "%{NAME}\n", path], timeout=60, probe=True)
        return set(res.output.split()) if res and res.returncode == 0 else set()

    def config_manager(self) -> Argv:
        """The command that adds and edits repository files: dnf's plugin (yum-utils' on EL 7)."""
        return ("dnf", "config-manager")

    def import_key(self, url: str) -> Argv:
        return ("rpm", "--import", url)

    # ------------------------------------------------------------ the preflight's scratch configuration

    def scratch_setup(self, scratch: Path) -> tuple[Argv, Argv]:
        """A scratch root with its own rpm database (keys are imported there, release packages unpacked there), and
        a copy of dnf.conf whose reposdir lists the scratch root's repository directory first, then the host's (a
        repository the plan redefines, behind --mirror, is the plan's). Every scratch command reads that copy
        (`--config`): a `config-manager --save` saves there, never into the host's dnf.conf (a `--setopt=reposdir`
        on its command line was saved into it). The host's rpm database is read, never written; its metadata cache
        is used and kept (the run reuses what the preflight fetched). Fetches time out (30 s, one retry)."""
        import configparser  # lazy: 2 ms, only the preflight reads dnf.conf

        (scratch / "rpms").mkdir()
        (scratch / "root" / SCRATCH_REPOS.lstrip("/")).mkdir(parents=True)
        conf = configparser.ConfigParser(interpolation=None, strict=False)
        conf.read_string(read_text(Path("/"), DNF_CONF) or "[main]\n")
        if not conf.has_section("main"):
            conf.add_section("main")
        conf.set("main", "reposdir", " ".join((f"{scratch}/root{SCRATCH_REPOS}", *HOST_REPOS)))
        text = io.StringIO()
        conf.write(text)
        write_file(scratch / "dnf.conf", text.getvalue(), backup=False, durable=False, keep_mode=False)
        return ((f"--config={scratch}/dnf.conf", "--setopt=timeout=30", "--setopt=retries=1"),
                (("rpm", "--root", f"{scratch}/root", "--initdb"),))

    def scratch_command(self, scratch: Path, argv: Argv) -> Argv | None:
        """A key imported into the scratch root's rpm database; a repository file added or edited with the config
        manager (the plan's own command) under the scratch's dnf.conf: in the scratch's repository directory."""
        if argv[:2] == ("rpm", "--import"):
            return ("rpm", "--root", f"{scratch}/root", *argv[1:])
        cm = self.config_manager()
        if argv[:len(cm)] == cm:
            return (cm[0], f"--config={scratch}/dnf.conf", *argv[1:])
        return None

    def scratch_release(self, scratch: Path, specs: Argv) -> tuple[Argv, ...]:
        """Each release package fetched (a URL with curl, a name with `dnf download` from the host's repositories),
        then unpacked into the scratch root by rpm (no scriptlets, no dependencies): its repository files land in the
        scratch's repository directory."""
        rpms = f"{scratch}/rpms"
        urls = [s for s in specs if "://" in s]
        names = tuple(s for s in specs if "://" not in s)
        return (*(("curl", "-fsSL", "--max-time", "60", "-o", f"{rpms}/{Path(u).name}", u) for u in urls),
                *((self.name, "download", "--destdir", rpms, *names),) * bool(names),
                ("sh", "-c", 'exec rpm --root "$1" -i --nodeps --noscripts --notriggers --nosignature --excludedocs '
                 '"$2"/*.rpm', "scratch-release", f"{scratch}/root", rpms))

    def answer(self, returncode: int, output: str) -> Answer:
        down = UNREACHABLE.search(output)
        if down:
            return Answer(unreachable=down.group(0).strip())
        missing = tuple(dict.fromkeys(m.strip() for m in NO_MATCH.findall(output)))
        if missing:
            return Answer(missing=missing)
        if returncode == 0 or "Operation aborted" in output or "Exiting on user command" in output:
            return Answer()
        lines = [ln.strip() for ln in output.splitlines() if ln.startswith(("Error:", " Problem", "  - ")) and
                 ln.strip() not in ("Error:",)]
        return Answer(problem="; ".join(lines[:6]) or f"exit status {returncode}")

    def bundle_options(self, bundle: Path, state: Path) -> Argv:
        """dnf pointed at the bundle's repository alone."""
        return ("--disablerepo=*", f"--repofrompath=gpuprov,file://{bundle}", "--enablerepo=gpuprov",
                "--setopt=gpuprov.gpgcheck=0", "--setopt=gpuprov.module_hotfixes=true")

    def bundle_files(self, bundle: Path, state: Path) -> tuple[tuple[str, str], ...]:
        return ()

    def download(self, packages: Argv, dest: str, release: int | None = None) -> tuple[Argv, ...]:
        """A bundle's build in a clean container of the target release: the packages with every dependency, their
        repository metadata, and the driver's module streams."""
        return (("dnf", "download", "--resolve", "--alldeps", f"--releasever={release}", "--destdir", dest,
                 *packages),
                ("createrepo_c", dest),
                # driver module streams: ship the stream's module metadata, or mark the repo module_hotfixes on install
                ("dnf", "module", "list", "--quiet", "nvidia-driver"))


class Yum(Dnf):
    """EL 7's yum: dnf's commands under yum's name, its own versionlock plugin and config manager, no streams."""
    name = "yum"
    module_streams = False
    # yum keeps its history in another database and has no `remove --duplicates` (yum-utils' package-cleanup
    # --cleandupes, yum-complete-transaction): not read here, so no recover step on EL 7
    recoverable = False
    hold_needs: Argv = ("yum-plugin-versionlock",)
    lock_list = "/etc/yum/pluginconf.d/versionlock.list"

    def scratch_setup(self, scratch: Path) -> None:
        return None  # yum has no config manager that takes a reposdir: EL 7's preflight is not asked

    def _erasing(self, allow_remove: bool) -> Argv:
        return ()  # yum has no --allowerasing: it replaces on obsoletes, which the dry run names

    def config_manager(self) -> Argv:
        return ("yum-config-manager",)
