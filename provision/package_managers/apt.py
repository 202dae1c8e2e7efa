"""apt (with dpkg under it) as gpuprov's package-manager adapter (provision/package_managers/base.py).

Holds: the driver's branch pin, by source package, in PIN_FILE (decide/kernel.py) rather than `apt-mark hold`: a hold
kept the security suite's in-branch driver update from the kernel that needed it (bookworm-security's 535.309.01 for
6.1.0-56), so the kernel arrived alone and its DKMS build failed. Pinned by source, the series moves together."""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Callable

from provision import effects
from provision.decide.kernel import METAPACKAGE_RE, PIN_FILE, PIN_PRIORITY, branch_of, pinned_branches, pinned_series
from provision.errors import StepFailed
from provision.facts.packages import InstalledPackage, UnfinishedPackage, apt_offers, dpkg_installed, dpkg_unfinished
from provision.facts.rootfs import read_text, under
from provision.package_managers.base import Answer, Argv, HoldWords, PackageManager

ENV = (("DEBIAN_FRONTEND", "noninteractive"), ("NEEDRESTART_MODE", "a"))
CACHE = "/var/cache/apt/archives"  # where apt keeps the .debs it downloaded (until apt-get clean)
REMV = re.compile(r"^Remv (\S+)", re.M)
# Ubuntu's precompiled NVIDIA modules: linux-modules-nvidia-<series>-<kernel or flavour> (the module package of one
# kernel, or the flavour's metapackage), linux-objects-nvidia-<series>-<kernel> (the objects the modules link from),
# and one kernel's linux-signatures-nvidia-<kernel>, shared by every series
LRM_PREFIXES = ("linux-modules-nvidia-", "linux-objects-nvidia-", "linux-signatures-nvidia-")
LRM_RE = re.compile(r"^linux-(modules|objects)-nvidia-(\d+(?:-server)?(?:-open)?)-(.+)$")
KERNEL_RE = re.compile(r"^\d+\.\d+\.\d+-\d+")  # a kernel's release (5.15.0-131-generic), not a flavour
SIGNATURES = "linux-signatures-nvidia-"
# apt's words for a name no source offers (LC_ALL=C): the preflight's exit 4, where anything else unresolved is 5
MISSING = re.compile(r"Unable to locate package (\S+)|Package '?([^' ]+)'? has no installation candidate|"
                     r"Version '[^']*' for '([^']+)' was not found|Couldn't find any package by \w+ '([^']+)'")
UNREACHABLE = re.compile(r"^(?:Err:\d*|[WE]: Failed to fetch) .*$", re.M)
SOURCES = ("/etc/apt/sources.list", "/etc/apt/sources.list.d/")


def _pin_script(pattern: str) -> str:
    """The branch pin (PIN_FILE) for the source packages of the packages named ("$@"), each at `pattern` (the shell
    expression of the pinned version, from $v, the installed one; epoch kept), written whole then renamed; then the
    `apt-mark hold`s an earlier gpuprov left on those sources' packages are taken off (the pin holds from then on)."""
    return ("set -e; f=" + PIN_FILE + "; dpkg-query -W -f '${source:Package} ${Version}\\n' \"$@\" | sort -u -k1,1 | "
            "while read -r s v; do printf 'Package: src:%s:any\\nPin: version %s\\nPin-Priority: "
            + str(PIN_PRIORITY) + "\\n\\nPackage: src:%s:any\\nPin: version *\\nPin-Priority: -1\\n\\n' "
            f"\"$s\" {pattern} \"$s\"; done > \"$f.tmp\"; mv \"$f.tmp\" \"$f\"; "
            "held=$(dpkg-query -W -f '${db:Status-Abbrev} ${source:Package} ${Package}\\n' | "
            "awk -v want=\" $(dpkg-query -W -f '${source:Package} ' \"$@\") \" "
            "'$1 == \"hi\" && index(want, \" \" $2 \" \") {print $3}'); "
            "if [ -n \"$held\" ]; then apt-mark unhold $held; fi")


PIN_SERIES = _pin_script('"${v%%.*}.*"')  # the branch installed: 535.*
# The version installed, exactly: what a rolled-back update leaves (the update that failed to build is not offered
# to apt again; the next `gpuprov bootstrap` that updates the series pins the branch again).
PIN_EXACT = _pin_script('"$v"')


def read_pins(root: Path) -> dict[str, str]:
    """The branch pin's sources and their version patterns ({} without the file)."""
    return pinned_branches(read_text(root, PIN_FILE) or "")


def restore_sources(root: Path, previous: tuple[str, ...]) -> tuple[str, ...]:
    """What a failed update's rollback installs for each name=version of the series before it: the .deb apt kept in
    its cache (apt knows no version that its lists no longer offer: once the archive carries only the update, the
    version that worked is in the cache alone), else name=version, from the archive."""
    out = []
    for p in previous:
        name, version = p.split("=", 1)
        hits = sorted(under(root, CACHE).glob(f"{glob.escape(name)}_{glob.escape(version.replace(':', '%3a'))}_*.deb"))
        out.append(f"{CACHE}/{hits[0].name}" if hits else p)
    return tuple(out)


class Apt(PackageManager):
    name = "apt"
    database = "dpkg"
    env = ENV
    checked_driver_install = True
    recoverable = True

    def refresh(self, opts: Argv = ()) -> Argv:
        return ("apt-get", *opts, "update")

    def simulate_install(self, packages: Argv, opts: Argv = (), verb: Argv = ("install",), remove: Argv = ()) -> Argv:
        return ("apt-get", *opts, "-s", *verb, "-y", "--no-install-recommends", *packages, *(f"{p}-" for p in remove))

    def install(self, packages: Argv, opts: Argv = (), verb: Argv = ("install",), allow_remove: bool = False,
                remove: Argv = ()) -> Argv:
        # --no-remove aborts on the packages named for removal (`NAME-`) too: such an install is guarded by its dry
        # run alone, which goes ahead only when it removes nothing else
        guard = () if allow_remove or remove else ("--no-remove",)
        return ("apt-get", *opts, *verb, "-y", "--no-install-recommends", *guard, *packages,
                *(f"{p}-" for p in remove))

    def removals(self, output: str) -> list[str]:
        return list(dict.fromkeys(REMV.findall(output)))

    def versions(self) -> dict[str, str]:
        res = effects.try_run(["dpkg-query", "-W", "-f", "${Package} ${Version} ${db:Status-Abbrev}\n"], timeout=60,
                              probe=True)
        return _installed_lines(res.output if res else "")

    def installed_packages(self, root: Path, match: Callable[[str], object]) -> dict[str, InstalledPackage]:
        """dpkg's status file under `root`, read as a file (provision/facts/packages.py)."""
        return dpkg_installed(root, match)

    def installed(self, packages: Argv, root: Path) -> bool:
        if not packages:
            return True
        try:
            p = effects.run(["dpkg-query", f"--admindir={under(root, 'var/lib/dpkg')}", "-W", "-f",
                             "${Package} ${Status}\n", *packages], check=False, probe=True)
        except StepFailed:  # dpkg itself is missing under this root: nothing is installed by it
            return False
        # held packages (an earlier gpuprov's `apt-mark hold`) are "hold ok installed"
        ok = {ln.split()[0] for ln in p.output.splitlines() if ln.endswith((" install ok installed",
                                                                             " hold ok installed"))}
        return all(pkg in ok for pkg in packages)

    def hold(self, packages: Argv) -> tuple[Argv, ...]:
        return (("sh", "-c", PIN_SERIES, "pin-series", *packages),)

    def hold_words(self, packages: Argv) -> HoldWords:
        return HoldWords(
            f"Pin the driver to its branch ({PIN_FILE}): the source packages of {' '.join(packages)}, at the branch "
            f"installed (priority {PIN_PRIORITY}; other versions -1)",
            ("updates within the branch install with apt's other upgrades (unattended-upgrades included), with the "
             "kernel that needs them; the userspace is newer than the loaded module until the reboot",
             "another branch: `gpuprov bootstrap --driver BRANCH`",
             "`apt-mark hold`s of an earlier gpuprov on these packages are taken off (the pin replaces them)"),
            f"skipped when {PIN_FILE} pins the source package of each of {' '.join(packages)} to the branch "
            "installed, and none of their packages is on apt-mark hold")

    def hold_exact(self, packages: Argv) -> Argv:
        """Pin the sources of `packages` at exactly the versions installed (a rolled-back update's pin)."""
        return ("sh", "-c", PIN_EXACT, "pin-exact", *packages)

    def driver_held(self, root: Path, packages: Argv) -> bool:
        """A driver metapackage of `packages` is in the series gpuprov pinned (decide/kernel.py: pinned_series)."""
        installed = pinned_series(dpkg_installed(root), read_pins(root))
        return any(METAPACKAGE_RE.match(p) and p in installed and installed[p].held for p in packages)

    def held(self, root: Path, packages: Argv) -> bool:
        installed = dpkg_installed(root)
        pins = read_pins(root)
        # the branch, or exactly the version installed (a rolled-back update's pin, kept until an update builds)
        if not all(p in installed and pins.get(installed[p].source) in (branch_of(installed[p].version),
                                                                          installed[p].version) for p in packages):
            return False
        return not any(p.held for p in installed.values() if p.source in pins)

    def unhold(self, names: Argv) -> Argv:
        return ("apt-mark", "unhold", *names)

    def unpin(self) -> Argv:
        """The branch pin removed (a change of branch: the new branch may share its sources)."""
        return ("rm", "-f", PIN_FILE)

    def mark_auto(self, names: Argv) -> Argv:
        return ("apt-mark", "auto", *names)

    def offered(self, package: str) -> Argv:
        """Asks the lists whether `package` is offered (its stanza on stdout, nothing when not)."""
        return ("apt-cache", "show", "--no-all-versions", package)

    def downgrade(self, packages: Argv, remove: Argv = ()) -> Argv:
        """Install `packages` (name=version or a cached .deb) even where that is a downgrade."""
        return ("apt-get", "install", "-y", "--allow-downgrades", *packages, *(f"{p}-" for p in remove))

    def configure_pending(self) -> Argv:
        return ("dpkg", "--configure", "-a")

    def audit(self) -> Argv:
        """Asks dpkg what is left broken (nothing printed: consistent)."""
        return ("dpkg", "--audit")

    def simulate_purge(self, packages: Argv) -> Argv:
        return ("apt-get", "-s", "purge", *packages)

    def purge(self, packages: Argv) -> Argv:
        return ("apt-get", "purge", "-y", *packages)

    def simulate_remove(self, packages: Argv) -> Argv:
        return ("apt-get", "-s", "remove", *packages)

    def remove(self, packages: Argv) -> Argv:
        """dpkg's remove: the prerm and postrm run with `remove`, never `purge` (the conffiles stay too)."""
        return ("apt-get", "remove", "-y", *packages)

    def removal_hint(self, root: Path, packages: Argv) -> tuple[Argv, ...]:
        return (("apt-get", "purge", *packages),)

    def purged_too(self, output: str, packages: Argv) -> list[str]:
        gone = [ln.split()[1] for ln in output.splitlines() if ln.startswith(("Purg ", "Remv "))]
        return sorted({p.split(":")[0] for p in gone} - {p.split(":")[0] for p in packages})

    def followers(self, root: Path, recorded: Argv) -> Argv:
        """Ubuntu's precompiled modules that gpuprov's metapackages pulled in after its own transactions, for every
        kernel (an upgrade's new ABI: linux-modules-nvidia-570-server-open-5.15.0-131-generic, its
        linux-objects-nvidia-… and linux-signatures-nvidia-5.15.0-131-generic): those of each series a recorded package
        names (a branch change's old series too: apt never offers its objects for autoremove), and the signatures of
        a kernel whose every installed module package is one of those (one kernel's signatures serve every series)."""
        series = {m.group(2) for p in recorded if (m := LRM_RE.match(p))}
        installed = dpkg_installed(root, lambda n: n.startswith(LRM_PREFIXES))
        ours = {n for n in installed if (m := LRM_RE.match(n)) and m.group(2) in series}
        kernels: dict[str, bool] = {}
        for n in installed:
            if (m := LRM_RE.match(n)) and KERNEL_RE.match(m.group(3)):
                kernels[m.group(3)] = kernels.get(m.group(3), True) and n in ours
        ours |= {n for n in installed if n.startswith(SIGNATURES) and kernels.get(n[len(SIGNATURES):])}
        return tuple(sorted(ours - set(recorded)))

    config_globs = ("/etc/apt/sources.list", "/etc/apt/sources.list.d/*", "/etc/apt/keyrings/*",
                    "/etc/apt/trusted.gpg.d/*", "/etc/apt/preferences.d/*")
    leftover_suffixes = (".dpkg-old", ".dpkg-dist", ".dpkg-new", ".dpkg-bak")

    def owners(self, root: Path, path: str) -> set[str]:
        res = effects.try_run(["dpkg-query", f"--admindir={under(root, 'var/lib/dpkg')}", "-S", path], timeout=60,
                              probe=True)
        if not res or res.returncode != 0:
            return set()
        return {n.strip().split(":")[0] for ln in res.output.splitlines() if ": " in ln
                and not ln.startswith(("diversion ", "local diversion ")) for n in ln.split(": ", 1)[0].split(",")}

    def bundle_options(self, bundle: Path, state: Path) -> Argv:
        """apt pointed at the bundle alone: its own sources list (written to state/bundle.list by the plan's step)
        and lists dir, no other sources, no network. Pure: planning writes nothing."""
        return ("-o", f"Dir::Etc::SourceList={state / 'bundle.list'}", "-o", "Dir::Etc::SourceParts=-",
                "-o", f"Dir::State::Lists={state / 'lists'}", "-o", "Acquire::Languages=none",
                "-o", "APT::Get::List-Cleanup=false")

    def preview_config(self, state: Path, main: str) -> tuple[tuple[str, str], ...]:
        """(path, content) of the files a scratch refresh's APT_CONFIG names (plan/archive_preview.py): apt reads that
        file first, then apt.conf.d, then Dir::Etc::main, so the main file it names (the host's apt.conf, `main`, then
        the clears) comes last and drops the hooks an update runs (APT::Update::Pre-Invoke, Post-Invoke,
        Post-Invoke-Success: docker-clean, command-not-found …), which a preview must not run on the host."""
        clears = "".join(f"#clear APT::Update::{h};\n" for h in ("Pre-Invoke", "Post-Invoke", "Post-Invoke-Success"))
        # the lists it fetches kept plain (Docker's Debian images keep them as .lz4, which the facts do not read)
        clears += 'Acquire::GzipIndexes "false";\n'
        return ((str(state / "apt.conf"), f'Dir::Etc::main "{state / "main.conf"}";\n'),
                (str(state / "main.conf"), main + "\n" + clears))

    def bundle_files(self, bundle: Path, state: Path) -> tuple[tuple[str, str], ...]:
        # trusted: the bundle's SHA256SUMS was verified before its repository is used
        return ((f"{state}/bundle.list", f"deb [trusted=yes] file:{bundle.resolve()} ./\n"),)

    def bundle_dirs(self, state: Path) -> Argv:
        return (f"{state}/lists/partial",)

    def interrupted(self, root: Path) -> bool:
        """dpkg's journal (updates/) holds what a killed run had not yet written to its status file."""
        return any(under(root, "var/lib/dpkg/updates").glob("*")) or bool(self.unfinished(root))

    def unfinished(self, root: Path) -> list[UnfinishedPackage]:
        return dpkg_unfinished(root)

    def unfetchable(self, root: Path, packages: list[UnfinishedPackage]) -> list[UnfinishedPackage]:
        return [u for u in packages if not apt_offers(root, u)]

    def refetch_hint(self, names: Argv) -> str:
        return (f"put its .deb in /var/cache/apt/archives, or take the archive's version with `apt-get install "
                f"--reinstall {' '.join(names)}`")

    def recover(self, allow_remove: bool, unfinished: list[UnfinishedPackage]) -> tuple[Argv, ...]:
        """Replay dpkg's journal (it fails for a package whose dependency was cut off mid-unpack, and for one whose
        own unpack was: dpkg's reinst-required), unpack those again at their installed version (the fix dpkg names:
        no apt run gets past them until then, unattended-upgrades included), then let apt repair the rest (removing
        nothing: a repair that needs a removal fails and names it)."""
        keep = () if allow_remove else ("--no-remove",)
        reinstall = tuple(u.spec for u in unfinished if u.reinstall)
        again = (("apt-get", "install", "--reinstall", "-y", "--no-install-recommends", *keep, *reinstall),) \
            if reinstall else ()
        return (self.configure_pending(), *again, ("apt-get", "install", "-f", "-y", "--no-install-recommends", *keep))

    def recover_may_fail(self, argv: Argv) -> bool:
        return argv == self.configure_pending()  # the reinstall and apt's repair after it finish what it cannot

    def recover_what(self, unfinished: list[UnfinishedPackage]) -> str:
        again = [u for u in unfinished if u.reinstall]
        rest = [u for u in unfinished if not u.reinstall]
        return "; ".join(part for part in (
            f"reinstall {', '.join(u.spec for u in again)}" if again else "",
            f"configure {', '.join(f'{u.name} ({u.state})' for u in rest)}" if rest else "") if part)

    def download(self, packages: Argv, dest: str, release: int | None = None) -> tuple[Argv, ...]:
        """Download `packages` and what a fresh host lacks of their dependencies into `dest` (a bundle's build, in a
        clean container of the target)."""
        return (("apt-get", "install", "-y", "--download-only", "--no-install-recommends", "-o",
                 f"Dir::Cache::archives={dest}", *packages),)

    def scratch_setup(self, scratch: Path) -> tuple[Argv, Argv]:
        """apt's sources, preferences, lists and cache pointed into `scratch`, seeded from the host's (its lists
        hard-linked: apt replaces a list by renaming a new file over it, never writing into the old one, so the
        host's stay as they were and its unchanged indexes are not fetched again); dpkg's status is the host's.
        Fetches time out (30 s, no retry): an unreachable mirror ends the preflight in seconds, not minutes."""
        (scratch / "sources.list.d").mkdir(parents=True)
        (scratch / "preferences.d").mkdir()
        (scratch / "cache" / "archives" / "partial").mkdir(parents=True)
        lists = scratch / "lists"
        (lists / "partial").mkdir(parents=True)
        _seed(Path("/etc/apt/sources.list"), scratch / "sources.list", link=False)
        for d in ("sources.list.d", "preferences.d"):
            for f in sorted(Path("/etc/apt", d).glob("*")):
                _seed(f, scratch / d / f.name, link=False)
        for f in sorted(Path("/var/lib/apt/lists").glob("*")):
            _seed(f, lists / f.name, link=True)
        scratch.chmod(0o755)  # apt fetches as _apt (its sandbox): the lists' partial directory is its
        _chown_apt(lists / "partial")
        opts = ("-o", f"Dir::Etc::SourceList={scratch}/sources.list",
                "-o", f"Dir::Etc::SourceParts={scratch}/sources.list.d",
                "-o", f"Dir::Etc::PreferencesParts={scratch}/preferences.d", "-o", f"Dir::State::Lists={lists}",
                "-o", f"Dir::Cache={scratch}/cache", "-o", "Acquire::Retries=0", "-o", "Acquire::http::Timeout=30",
                "-o", "Acquire::https::Timeout=30", "-o", "APT::Get::List-Cleanup=false")
        return opts, ()

    def scratch_file(self, scratch: Path, path: str) -> Path | None:
        if path == SOURCES[0]:
            return scratch / "sources.list"
        if path.startswith(SOURCES[1]) and "/" not in path[len(SOURCES[1]):]:
            return scratch / "sources.list.d" / path[len(SOURCES[1]):]
        return None

    def scratch_command(self, scratch: Path, argv: Argv) -> Argv | None:
        """A keyring the plan fetches into /etc/apt/keyrings is fetched to the same name in the scratch's own
        keyrings (the preflight points the scratch sources' signed-by there); its directory made there; the
        branch pin removed from the scratch's preferences (a change of branch)."""
        if argv[:1] == ("curl",) and "-o" in argv and argv[argv.index("-o") + 1].startswith("/etc/apt/"):
            i = argv.index("-o") + 1
            return (*argv[:i], str(scratch / "keyrings" / Path(argv[i]).name), *argv[i + 1:])
        if argv[:1] == ("install",) and argv[-1] == "/etc/apt/keyrings":
            return (*argv[:-1], str(scratch / "keyrings"))
        if argv == self.unpin():
            return ("rm", "-f", str(scratch / "preferences.d" / Path(PIN_FILE).name))
        return None

    def scratch_refresh(self, scratch: Path) -> Argv:
        return ("apt-get", "update")

    def answer(self, returncode: int, output: str) -> Answer:
        down = UNREACHABLE.search(output)
        if down:  # apt-get update says so and exits 0: the lists of that source are stale or missing
            return Answer(unreachable=down.group(0).strip())
        if returncode == 0:
            return Answer()
        missing = tuple(dict.fromkeys(next(g for g in m.groups() if g) for m in MISSING.finditer(output)))
        if missing:
            return Answer(missing=missing)
        lines = [ln.strip() for ln in output.splitlines() if ln.startswith((" ", "E: ")) and ln.strip()]
        return Answer(problem="; ".join(lines[:6]) or f"exit status {returncode}")

    def how_to_get(self, package: str) -> str:
        """How an operator installs `package` on this (Debian-family) machine, in words for a message."""
        return f"apt-get install {package}"


def _seed(src: Path, dst: Path, link: bool) -> None:
    """A host file of apt's into the scratch configuration: regular files only (a link, FIFO or device is never
    followed or opened), hard-linked where `link` and possible, else copied."""
    import shutil  # lazy: 3 ms, only the preflight copies

    try:
        if not src.is_file() or src.is_symlink():
            return
        if link:
            try:
                os.link(src, dst)
                return
            except OSError:
                pass
        shutil.copyfile(src, dst)
    except OSError:
        pass


def _chown_apt(path: Path) -> None:
    import pwd  # lazy: 0.05 ms, only the preflight asks

    try:
        os.chown(path, pwd.getpwnam("_apt").pw_uid, -1)
    except (KeyError, OSError):
        pass  # no _apt user: apt fetches as root (and says so)


def _installed_lines(output: str) -> dict[str, str]:
    out = {}
    for line in output.splitlines():
        words = line.split()
        if len(words) >= 3 and words[2][1:2] == "i":  # dpkg's "ii"/"hi": installed (not just known or removed)
            out[words[0]] = words[1]
    return out
