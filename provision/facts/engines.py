"""Container engines present on a host: binary, version, config path, whether the config parses, runtimes."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from provision.facts.rootfs import read_bytes_bounded, under

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # pragma: no cover - Python 3.9/3.10
    tomllib = None
    import tomlkit  # the TOML parser there (3.9/3.10 have no tomllib)

# containerd's CRI plugin per config version (version 3, containerd 2.x, split the plugin; its runtime part holds the
# runtimes). The one table: the containerd adapter (engines/containerd.py) uses it too.
CRI_PLUGIN = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
BIN_DIRS = ("usr/bin", "usr/sbin", "usr/local/bin", "usr/local/sbin", "bin", "sbin")


@dataclass(frozen=True)
class EngineSpec:
    name: str
    binary: str
    config: str
    version_args: tuple[str, ...]


ENGINES = (
    EngineSpec("docker", "dockerd", "/etc/docker/daemon.json", ("--version",)),
    EngineSpec("containerd", "containerd", "/etc/containerd/config.toml", ("--version",)),
    EngineSpec("podman", "podman", "/etc/containers/containers.conf", ("--version",)),
    EngineSpec("cri-o", "crio", "/etc/crio/crio.conf", ("--version",)),
)


@dataclass(frozen=True)
class EngineFacts:
    name: str
    binary: str | None
    version: str | None
    config_path: str
    config_exists: bool
    config_valid: bool | None  # None when there is no config file (engine defaults apply)
    config_error: str | None
    runtimes: tuple[str, ...]
    default_runtime: str | None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["runtimes"] = list(self.runtimes)
        return d


def find_binary(root: Path, name: str) -> str | None:
    for d in BIN_DIRS:
        p = under(root, f"{d}/{name}")
        if p.is_file():
            return "/" + f"{d}/{name}"
    return None


def _toml_load(text: str) -> dict:
    if tomllib is None:  # pragma: no cover - targets with Python 3.9/3.10
        return tomlkit.parse(text).unwrap()
    return tomllib.loads(text)


def _dig(d: dict, *keys: str) -> dict:
    for k in keys:
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d if isinstance(d, dict) else {}


def parse_config(name: str, text: str) -> tuple[tuple[str, ...], str | None, dict]:
    """(runtimes, default runtime, extra) from an engine's config text; raises ValueError when it does not parse."""
    if name == "docker":
        doc = json.loads(text) if text.strip() else {}
        if not isinstance(doc, dict):
            raise ValueError("top level is not a JSON object")
        runtimes = tuple(["runc", *[r for r in doc.get("runtimes", {}) if r != "runc"]])
        return runtimes, doc.get("default-runtime", "runc"), {"cdi": bool(_dig(doc, "features").get("cdi"))}
    doc = _toml_load(text)
    if name == "containerd":
        version = doc.get("version", 1)
        if type(version) is not int or version not in CRI_PLUGIN:
            raise ValueError(f"`version = {version!r}` is not a containerd config version (1, 2 or 3)")
        c = _dig(doc, "plugins", CRI_PLUGIN[version], "containerd")
        return tuple(c.get("runtimes", {})), c.get("default_runtime_name"), {"version": version}
    if name == "cri-o":
        rt = _dig(doc, "crio", "runtime")
        return tuple(rt.get("runtimes", {})), rt.get("default_runtime"), {}
    eng = _dig(doc, "engine")
    return tuple(eng.get("runtimes", {})), eng.get("runtime"), {}


def _containerd_imports(root: Path, main: str, text: str, runtimes: tuple[str, ...],
                        default: str | None) -> tuple[tuple[str, ...], str | None]:
    """Runtimes defined in the files the main config imports (gpuprov's own drop-in among them), read under
    `root`: listed with the main file's, the last default named wins. (containerd's exact merge rules differ by
    version; detect reports what is registered, `containerd config dump` is the engine's own answer.)"""
    imports = _toml_load(text).get("imports") or []
    seen = list(runtimes)
    for entry in imports if isinstance(imports, list) else []:
        path = entry if str(entry).startswith("/") else str(Path(main).parent / str(entry))
        for f in sorted(under(root, "/").glob(path.lstrip("/"))):
            try:
                more, dflt, _ = parse_config("containerd", read_bytes_bounded(f).decode())
            except (OSError, ValueError, TypeError):
                continue  # an unreadable import is containerd's to refuse, not detect's
            seen += [r for r in more if r not in seen]
            default = dflt or default
    return tuple(seen), default


def read_engines(root: Path) -> list[EngineFacts]:
    """Engines found under `root`, by their binaries and config files (read only; `version` is left None: it
    takes running the binary, which `provision.probe.engines.with_versions` does on the live host)."""
    found = []
    binaries = {spec.name: find_binary(root, spec.binary) for spec in ENGINES}
    for spec in ENGINES:
        cfg = under(root, spec.config)
        text = None
        try:
            text = read_bytes_bounded(cfg).decode()  # a FIFO or huge file here must not hang detect
        except OSError:
            pass
        if binaries[spec.name] is None and text is None:
            continue
        runtimes: tuple[str, ...] = ()
        default = None
        extra: dict = {}
        valid: bool | None = None
        error = None
        if text is not None:
            try:
                runtimes, default, extra = parse_config(spec.name, text)
                if spec.name == "containerd":
                    runtimes, default = _containerd_imports(root, spec.config, text, runtimes, default)
                valid = True
            except (ValueError, TypeError) as exc:  # json/toml decode errors are ValueErrors
                valid, error = False, str(exc).splitlines()[0]
        elif spec.name == "docker":
            runtimes, default = ("runc",), "runc"
        found.append(
            EngineFacts(
                name=spec.name, binary=binaries[spec.name], version=None,
                config_path=spec.config, config_exists=text is not None, config_valid=valid, config_error=error,
                runtimes=runtimes, default_runtime=default, extra=extra,
            )
        )
    return found
