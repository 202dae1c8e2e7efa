"""A package manager as an adapter, like an engine (provision/engines/base.py): everything gpuprov asks of apt or of
dnf/yum goes through one `PackageManager`, and no module outside provision/package_managers/ names a package-manager
command or branches on a package manager's name (tests/unit/test_engine_literals.py).

An adapter answers with argv tuples and facts, never runs a change itself: the plan (provision/plan/) wraps each argv
in a printed-and-run Command, so what the plan prints is what runs. It owns:
- the install transaction: its dry run (`simulate_install`) and the install in a form that cannot remove (`install`),
  with `removals` reading what a dry run says it would remove; the lists' refresh (`refresh`);
- what is installed and at which version (`versions`, `installed`, `installed_packages`);
- holds (`hold`, `held`, `unhold`): apt's branch pin, dnf's versionlock;
- the purge of what gpuprov installed (`simulate_purge`, `purge`, `purged_too`), its removal that keeps what a purge
  deletes (`simulate_remove`, `remove`), and the way out it names for what it did not install (`removal_hint`);
- an offline bundle's repository as the only source (`bundle_options`, `bundle_files`);
- the install record: whether a transaction's dependencies are recorded with it (`records_dependencies`);
- the preflight's scratch configuration (provision/plan/preflight.py): the host's repositories plus those the plan
  adds, where an install's dry run asks "is it offered, does it resolve" before the first change (`scratch_setup`,
  `scratch_command`, `scratch_file`, `scratch_release`, `scratch_refresh`, `answer`; None/() where unsupported).

The subclass sets or implements: `name`, `database`, `env`, `records_dependencies`, `refresh`, `simulate_install`,
`install`, `removals`, `versions`, `installed`, `installed_packages`, `hold`, `held`, `unhold`, `simulate_purge`,
`purge`, `purged_too`, `removal_hint`, `offered`, `bundle_options`, `bundle_files`, `download`, `recover`,
`interrupted`, `unfinished`, `unfetchable`, `refetch_hint`, `recover_may_fail`, `recover_dry_run`, `recover_removes`,
`recover_what`, `hold_words`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, ClassVar, NamedTuple

from provision.facts.packages import InstalledPackage, UnfinishedPackage

Argv = tuple[str, ...]
Env = tuple[tuple[str, str], ...]


class Answer(NamedTuple):
    """What a dry run (or a refresh) in the preflight's scratch configuration said, read from its output:
    `missing`: names no repository offers (exit 4); `problem`: the resolver's own lines where it found no
    transaction (exit 5); `unreachable`: a repository could not be read (the question was not asked)."""
    missing: tuple[str, ...] = ()
    problem: str = ""
    unreachable: str = ""


class HoldWords(NamedTuple):
    """How the plan says a hold: the step's title, its notes, and its check's description."""
    title: str
    notes: tuple[str, ...]
    check: str


class PackageManager(ABC):
    name: ClassVar[str]  # apt | dnf | yum: what Target.package_manager says
    database: ClassVar[str]  # dpkg | rpm: what a check's description names
    env: ClassVar[Env] = ()  # the environment every command of this manager runs with
    # The record keeps every package a transaction added, for every manager (plan/packages.py: InstallWatch); apt's
    # also notes the packages asked for (plan/apply.py: missing_packages), which dnf's watch sees as its own
    records_dependencies: ClassVar[bool] = False
    # module streams (NAME:STREAM specs) are this manager's: dnf's `module install/switch-to`
    module_streams: ClassVar[bool] = False
    # the driver's own install action with its DKMS check and rollback (provision/plan/dkms.py: DriverInstall)
    checked_driver_install: ClassVar[bool] = False
    # a killed run can leave this manager's database half-configured: the plan's recover step runs `recover()`
    recoverable: ClassVar[bool] = False

    # ------------------------------------------------------------ the install transaction

    def preview_config(self, state: Path, main: str) -> tuple[tuple[str, str], ...]:
        """(path, content) of files that keep a scratch refresh in `state` from running the package manager's hooks
        on the host (apt's: the APT_CONFIG file and the main file it names); () where there are none."""
        return ()

    @abstractmethod
    def refresh(self, opts: Argv = ()) -> Argv | None:
        """The command that refreshes the package lists before an install; None where the install does itself."""

    @abstractmethod
    def simulate_install(self, packages: Argv, opts: Argv = (), verb: Argv = ("install",), remove: Argv = ()) -> Argv:
        """The dry run of an install: what it would install and remove, changing nothing."""

    @abstractmethod
    def install(self, packages: Argv, opts: Argv = (), verb: Argv = ("install",), allow_remove: bool = False,
                remove: Argv = ()) -> Argv:
        """The install, in a form that cannot remove a package unless `allow_remove` (or `remove` names it)."""

    def upgrade_verb(self) -> Argv:
        """The verb that brings installed packages to their newest candidate (the install's own where it does)."""
        return ("install",)

    def unlocked(self) -> Argv:
        """Options for a transaction that moves packages gpuprov's hold keeps (its hold step renews the holds after;
        a failed or killed run leaves them as they were)."""
        return ()

    @abstractmethod
    def offered(self, package: str) -> Argv:
        """Asks whether `package` (a name, or a version glob where the manager takes one) is offered: nothing
        printed, or a non-zero exit, when it is not."""

    @abstractmethod
    def removals(self, output: str) -> list[str]:
        """The installed packages a dry run's output says the transaction removes, in order, once each."""

    # ------------------------------------------------------------ what is installed

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """Every installed package and its version, from the live database (one query)."""

    @abstractmethod
    def installed(self, packages: Argv, root: Path) -> bool:
        """All of `packages` installed, by the database under `root` (reads only)."""

    @abstractmethod
    def installed_packages(self, root: Path, match: Callable[[str], object]) -> dict[str, InstalledPackage]:
        """The installed packages whose name `match`es, with their versions, from the database under `root` (reads
        only): what the plan tells an operator's driver by (provision/facts/driver_facts.py: installed_driver)."""

    # ------------------------------------------------------------ holds

    @abstractmethod
    def hold(self, packages: Argv) -> tuple[Argv, ...]:
        """The commands that hold the driver's packages at their branch or version."""

    hold_needs: ClassVar[Argv] = ()  # packages `hold` needs installed first (dnf's versionlock plugin)

    @abstractmethod
    def hold_words(self, packages: Argv) -> HoldWords: ...

    @abstractmethod
    def held(self, root: Path, packages: Argv) -> bool:
        """`packages` are held as `hold` holds them (read under `root`)."""

    def driver_held(self, root: Path, packages: Argv) -> bool:
        """The driver a plan installs (`packages`; a module stream by its module's name) is installed and held as
        gpuprov's hold step holds it: the driver gpuprov installed, which it keeps following (a kernel that boots
        without its module, another kernel-module flavour)."""
        names = tuple(dict.fromkeys(p.split(":")[0] for p in packages))
        return bool(names) and self.held(root, names)

    def holds_among(self, root: Path, holds: Argv, packages: Argv) -> Argv:
        """What `unhold` takes off before a purge of `packages`: gpuprov's recorded `holds` (apt's)."""
        return holds

    def holds_others(self, root: Path, names: set[str]) -> bool:
        """The hold mechanism keeps holds on packages other than `names` (which `hold_needs` must stay for)."""
        return False

    @abstractmethod
    def unhold(self, names: Argv) -> Argv:
        """Take gpuprov's holds off `names`."""

    # ------------------------------------------------------------ purge

    @abstractmethod
    def simulate_purge(self, packages: Argv) -> Argv: ...

    @abstractmethod
    def purge(self, packages: Argv) -> Argv: ...

    def simulate_remove(self, packages: Argv) -> Argv:
        """The dry run of `remove`."""
        return self.simulate_purge(packages)

    def remove(self, packages: Argv) -> Argv:
        """The packages removed without their purge scripts (the data their purge deletes kept: Debian's docker.io
        deletes /var/lib/docker on purge alone); where the manager has no purge, its purge."""
        return self.purge(packages)

    @abstractmethod
    def purged_too(self, output: str, packages: Argv) -> list[str]:
        """What the purge's dry run would remove beyond `packages` (sorted names)."""

    @abstractmethod
    def removal_hint(self, root: Path, packages: Argv) -> tuple[Argv, ...]:
        """The commands an operator runs to remove `packages` gpuprov did not install (printed, never run: gpuprov
        does not remove what it did not install)."""

    def purge_dry_run_ok(self, returncode: int, output: str) -> bool:
        """The purge's dry run answered (its exit status for "would do this, did nothing")."""
        return returncode == 0

    def followers(self, root: Path, recorded: Argv) -> Argv:
        """The installed packages that gpuprov's recorded packages brought in after its own transactions (a
        metapackage's new dependency, installed by the operator's upgrade): purged with them."""
        return ()

    # ------------------------------------------------------------ configuration: repositories and keys

    # the manager's configuration files (globs, read under a root): what a step is watched for (plan/pkgconfig.py) and
    # the only files uninstall removes or gives back from the record's `repo_config`
    config_globs: ClassVar[Argv] = ()
    # what the manager leaves of a changed config file when its package goes (rpm's .rpmsave, dpkg's .dpkg-old …)
    leftover_suffixes: ClassVar[Argv] = ()
    purge_leaves: ClassVar[Argv] = ()  # … those of them that its purge leaves (named before it is there)

    def imported_keys(self, root: Path) -> set[str]:
        """The signing keys in the manager's own keyring under `root` (rpm's gpg-pubkey packages); apt has none
        outside its keyring files."""
        return set()

    def forget_keys(self, keys: Argv) -> Argv:
        """The command that removes imported `keys`."""
        raise NotImplementedError(f"{self.name} imports no keys")

    def owners(self, root: Path, path: str) -> set[str]:
        """The installed packages that own `path` (read under `root`); empty when none does."""
        return set()

    # ------------------------------------------------------------ what a transaction added

    def snapshot(self) -> dict[str, str]:
        """Every installed package, keyed by what `added` compares (one query): name -> name."""
        return {n: n for n in self.versions()}

    def added(self, before: dict[str, str], after: dict[str, str]) -> list[str]:
        """The packages new to the database between two snapshots (what the install record keeps of a step)."""
        return [n for n in after if n not in before]

    # ------------------------------------------------------------ bundles and recovery

    @abstractmethod
    def bundle_options(self, bundle: Path, state: Path) -> Argv:
        """Options that point every install at an offline bundle's repository alone."""

    @abstractmethod
    def bundle_files(self, bundle: Path, state: Path) -> tuple[tuple[str, str], ...]:
        """(path, content) of the files those options need written first."""

    @abstractmethod
    def download(self, packages: Argv, dest: str, release: int | None = None) -> tuple[Argv, ...]:
        """A bundle's build: the commands that fetch `packages` with every dependency into `dest`."""

    def bundle_dirs(self, state: Path) -> Argv:
        """The directories those options need made first."""
        return ()

    def interrupted(self, root: Path) -> bool:
        """Whether a run of this manager under `root` was cut off and left something to finish (`recover`)."""
        return bool(self.unfinished(root))

    def unfinished(self, root: Path) -> list[UnfinishedPackage]:
        """The packages a killed run left part-way, read from the database under `root` (only where `recoverable`)."""
        return []

    def unfetchable(self, root: Path, packages: list[UnfinishedPackage]) -> list[UnfinishedPackage]:
        """Those of `packages` (to be installed again at their version) that this manager can no longer fetch at that
        version (neither its cache nor its lists or repositories have it)."""
        return []

    def refetch_hint(self, names: Argv) -> str:
        """How an operator gets the packages NAMES installed again when `unfetchable` names them, in words."""
        return ""

    def recover(self, allow_remove: bool, unfinished: list[UnfinishedPackage]) -> tuple[Argv, ...]:
        """The commands that finish what a killed run left half-done (only where `recoverable`), given what
        `unfinished` found."""
        return ()

    def recover_may_fail(self, argv: Argv) -> bool:
        """Whether that command of `recover`'s may fail without failing the recovery (the next one repairs it)."""
        return False

    def recover_dry_run(self, unfinished: list[UnfinishedPackage]) -> Argv | None:
        """The dry run of the one `recover` command that removes packages, where there is one (None: the commands
        remove nothing, or refuse to themselves): the recovery goes ahead only when that dry run removes nothing but
        `recover_removes`."""
        return None

    def recover_removes(self, unfinished: list[UnfinishedPackage]) -> Argv:
        """The names whose packages the recovery removes on purpose (rpm's older duplicates)."""
        return ()

    def recover_what(self, unfinished: list[UnfinishedPackage]) -> str:
        """What the recovery does, in words, for the step's title ("" when nothing is part-way)."""
        return ""

    # ------------------------------------------------------------ the preflight's scratch configuration

    def scratch_setup(self, scratch: Path) -> tuple[Argv, Argv] | None:
        """Make `scratch` (an empty private directory) a configuration with the host's repositories as they are,
        reading the host's package database, changing nothing of the host: (the options every scratch command takes,
        the commands that finish the setup). None where this manager has none (the preflight is then not asked)."""
        return None

    def scratch_command(self, scratch: Path, argv: Argv) -> Argv | None:
        """The plan's repository command `argv` (a key imported, a repository file added or edited) in its scratch
        form; () when it changes nothing the questions depend on; None when it is no repository command."""
        return None

    def scratch_file(self, scratch: Path, path: str) -> Path | None:
        """Where a file the plan writes at `path` goes in the scratch configuration (a sources file); None: not a
        file of the package manager's repository configuration."""
        return None

    def scratch_release(self, scratch: Path, specs: Argv) -> tuple[Argv, ...]:
        """The commands that put the repository files of release packages `specs` (elrepo-release, a URL or a name)
        into the scratch configuration, with no package installed on the host."""
        return ()

    def scratch_refresh(self, scratch: Path) -> Argv | None:
        """The scratch configuration's lists refreshed (None: the dry run reads the repositories itself)."""
        return None

    def answer(self, returncode: int, output: str) -> Answer:
        """A scratch dry run's (or refresh's) output read: what is missing, what does not resolve, what could not
        be reached; all empty where it resolved."""
        return Answer()
