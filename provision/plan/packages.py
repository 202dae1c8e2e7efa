"""Package installs as steps: the commands that install packages (apt, dnf/yum, or an offline bundle's repository
alone) and the step that runs them with its check. Shared by the engine's and the driver's steps."""
from __future__ import annotations

from pathlib import Path

from provision import paths
from provision.decide.targets import Target
from provision.options import Stage
from provision.plan import repos
from provision.plan.steps import Command, PackagesInstalled, Step, WriteFile

APT_ENV = (("DEBIAN_FRONTEND", "noninteractive"), ("NEEDRESTART_MODE", "a"))
BUNDLE_APT = paths.BUNDLE_APT


def install_actions(target: Target, packages: tuple[str, ...], bundle: str | None = None) -> list:
    """The commands that install `packages`: apt refreshes its lists first (each package step, so a step that runs
    alone after an earlier run never installs from stale lists); with a bundle, apt sees the bundle alone."""
    if target.package_manager == "apt":
        opts: list[str] = []
        pre: list = []
        if bundle:
            opts = repos.apt_options(Path(bundle), Path(BUNDLE_APT))
            pre = [Command(("install", "-d", "-m", "0755", f"{BUNDLE_APT}/lists/partial")),
                   WriteFile(f"{BUNDLE_APT}/bundle.list", repos.source_list(Path(bundle)))]
        if not packages:
            return pre
        return pre + [Command(("apt-get", *opts, "update"), APT_ENV),
                      Command(("apt-get", *opts, "install", "-y", "--no-install-recommends", *packages), APT_ENV)]
    if bundle:
        return [Command(tuple(repos.dnf_install_cmd(bundle, list(packages))))]
    pm = target.package_manager
    mods = [p for p in packages if ":" in p]
    plain = [p for p in packages if ":" not in p]
    cmds = [Command((pm, "install", "-y", *plain))] if plain else []
    cmds += [Command((pm, "module", "install", "-y", m)) for m in mods]
    return cmds


def package_step(sid: str, stage: Stage, title: str, target: Target, packages: tuple[str, ...],
                 pre: tuple[Command, ...] = (), bundle: str | None = None, check=None, **kw) -> Step:
    hint = (f"a package may be missing from bundle {bundle}: rebuild it with `gpuprov bundle create`; nothing was "
            "fetched from the network") if bundle else None
    return Step(sid, stage, title, actions=(*([] if bundle else pre), *install_actions(target, packages, bundle)),
                check=check or PackagesInstalled(target.package_manager, packages), hint=hint, **kw)
