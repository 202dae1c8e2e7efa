"""What plan and bootstrap decide from: bootstrap's options as one frozen value, checked against provision/options.py's
choices when it is made (a dataclass: it validates itself; `gpuprov detect`, which needs only the choices, does not
load it)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from provision.decide.gputable import parse_pci_id
from provision.errors import UsageError
from provision.options import (
    CHOICES,
    MODULE_PARAMS,
    DriverSource,
    Engine,
    EngineSource,
    KernelModules,
    Mirror,
    Stage,
    check_choice,
    values,
)
from provision.values import PARAMS, BadValue, check


@dataclass(frozen=True)
class Options:
    """bootstrap's and plan's options, decided from as one value. A field with choices (CHOICES) holds one of them:
    anything else is refused when the value is made (exit 2, the option named), so no plan sees it."""
    driver: str = "auto"  # auto | skip | a driver branch ("535")
    kernel_modules: str = KernelModules.AUTO.value
    driver_source: str = DriverSource.DISTRO.value
    engine: str = Engine.DOCKER.value
    engine_source: str = EngineSource.AUTO.value  # auto: the distro's Docker; EL ships none -> docker-ce
    runtime_name: str = "nvidia"
    default_runtime: bool = True
    cdi: bool = False
    validate: bool = True
    bundle: str | None = None  # an offline bundle's repository: packages come from it alone
    replace_runtime: bool = False  # --replace-runtime: the operator's runtime of that name / default may be replaced
    allow_remove: bool = False  # --allow-remove: a package install may remove installed packages (plan/packages.py)
    restart_engine: bool = False  # --restart-engine: a needed dockerd restart may stop running containers
    mirrors: dict[str, str] = field(default_factory=dict)  # repository name -> base URL (plan/repos.BASES)
    stages: tuple[str, ...] = values(Stage)  # bootstrap --only: the stages whose steps are planned
    for_gpus: tuple[str, ...] = ()  # image baking: decide as if these PCI ids were present
    kernels: tuple[str, ...] = ()  # build the driver for these kernels (default: see plan/driver.py)
    persistence: bool = True  # nvidia-persistenced installed and enabled with the driver on data-centre GPUs
    # --engine-option KEY=JSON: the operator's own daemon.json keys, merged with gpuprov's (engines/docker.merge)
    engine_options: tuple[tuple[str, str], ...] = ()
    engine_users: tuple[str, ...] = ()  # --engine-user: accounts added to the engine's group (docker)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in CHOICES:
                check_choice(getattr(self, f.name), CHOICES[f.name], "--" + f.name.replace("_", "-"))
        # daemon.json keys and the docker group are Docker's: refused for another engine rather than ignored
        for given, option in ((self.engine_options, "--engine-option"), (self.engine_users, "--engine-user")):
            if given and self.engine != Engine.DOCKER.value:
                raise UsageError(f"{option} is for --engine docker (daemon.json keys, the docker group); "
                                 f"--engine is {self.engine}")

    @classmethod
    def parse(cls, *, driver: str = "auto", kernel_modules: str = "auto", driver_source: str = "distro",
              engine: str = "docker", engine_source: str = "auto", runtime_name: str = "nvidia",
              no_default: bool = False, cdi: bool = False, no_validate: bool = False, replace_runtime: bool = False,
              allow_remove: bool = False, only: str | None = None, mirror=(), for_gpus=None, kernels=None,
              restart_engine: bool = False, no_persistence: bool = False, engine_option=(),
              engine_user=()) -> Options:
        """From the command line's values, named as bootstrap's parameters are (MODULE_PARAMS' keys): each checked
        and parsed here, one `--OPTION …` line and exit 2 for a bad one."""
        for name, value in (("kernel_modules", kernel_modules), ("driver_source", driver_source), ("engine", engine),
                            ("engine_source", engine_source)):
            check_choice(value, CHOICES[name], "--" + name.replace("_", "-"))
        for p in for_gpus or ():
            parse_pci_id(p)  # a malformed id is a usage error before anything is planned
        return cls(driver=driver, kernel_modules=kernel_modules, driver_source=driver_source, engine=engine,
                   engine_source=engine_source, runtime_name=runtime_name, default_runtime=not no_default, cdi=cdi,
                   validate=not no_validate, replace_runtime=replace_runtime, allow_remove=allow_remove,
                   restart_engine=restart_engine, stages=_parse_stages(only), mirrors=_parse_mirrors(list(mirror or ())),
                   for_gpus=tuple(for_gpus or ()), kernels=tuple(kernels or ()), persistence=not no_persistence,
                   engine_options=_parse_engine_options(list(engine_option or ())),
                   engine_users=tuple(dict.fromkeys(engine_user or ())))


def _parse_engine_options(items: list[str]) -> tuple[tuple[str, str], ...]:
    """KEY=JSON each (values.engine_option has checked them): (key, JSON text), the last one of a key winning."""
    out: dict[str, str] = {}
    for item in items:
        try:
            check(PARAMS[MODULE_PARAMS["engine_option"]], item)
        except BadValue as exc:
            raise UsageError(f"--engine-option {exc}") from None
        key, _, doc = item.partition("=")
        out[key] = doc
    return tuple(out.items())


def _parse_mirrors(mirror: list[str]) -> dict[str, str]:
    out = {}
    for item in mirror:
        name, sep, url = item.partition("=")
        if not sep or name not in values(Mirror):
            raise UsageError(f"--mirror {item!r}: use NAME=URL with NAME one of {', '.join(values(Mirror))} "
                             "(e.g. docker-ce=https://mirror.example/docker-ce/linux)")
        try:
            out[name] = check(PARAMS[MODULE_PARAMS["mirror"]], url)
        except BadValue as exc:
            raise UsageError(f"--mirror {item!r}: the URL must be {exc.rule}") from None
    return out


def _parse_stages(only: str | None) -> tuple[str, ...]:
    if only is None:
        return values(Stage)
    stages = tuple(s.strip() for s in only.split(",") if s.strip())
    bad = [s for s in stages if s not in values(Stage)]
    if bad or not stages:
        raise UsageError(f"--only {only!r}: a comma list of {', '.join(values(Stage))}")
    return stages
