"""Docker's daemon.json: a structural merge that keeps every existing key, value and order."""
from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

from provision import effects, paths
from provision.engines import validate
from provision.engines.base import (
    RUNTIME_PATH,
    Change,
    ContainerRun,
    Daemon,
    Engine,
    EnginePlan,
    FileEdit,
    ImageImport,
    Run,
    RuntimeRequest,
    Validation,
    dump_json,
    flag_value,
    load_json_strict,
    read_config,
    undo_text,
)
from provision.errors import ConfigInvalid, RestartRefused, RuntimeConflict, StepFailed
from provision.facts.engine_data import StoredData, docker_store, repository, short
from provision.facts.engines import spec
from provision.facts.rootfs import is_live, read_text_file, under
from provision.fsutil import read_trusted, write_file
from provision.hook_presence import hook_present_since

SPEC = spec("docker")  # binary, default config, its flag, packages, units: facts/engines.py's one table
DAEMON_JSON = SPEC.config
UNIT_FILES = ("/lib/systemd/system/docker.service", "/usr/lib/systemd/system/docker.service",
              "/etc/systemd/system/docker.service")
DROPIN_DIR = "/etc/systemd/system/docker.service.d"
DATA_ROOT = "/var/lib/docker"  # dockerd's default data root, and the one Debian's docker.io purge deletes
CONTAINERS = f"{DATA_ROOT}/containers"  # dockerd's own store: <id>/config.v2.json (name, labels)
# What the live dockerd keeps, for uninstall's purge (stored): its data root, then every container (name, image as
# asked), every image (id, repository:tag; `-a`: the untagged too) and every volume.
ROOT_DIR = ("docker", "info", "--format", "{{.DockerRootDir}}")
ALL_CONTAINERS = ("docker", "ps", "-a", "--no-trunc", "--format", "{{.Names}}\t{{.Image}}")
ALL_IMAGES = ("docker", "image", "ls", "-a", "--no-trunc", "--format", "{{.ID}}\t{{.Repository}}:{{.Tag}}")
ALL_VOLUMES = ("docker", "volume", "ls", "-q")
RUNTIMES = ("docker", "info", "--format", "{{json .Runtimes}}")  # the runtimes the live dockerd lists
# What the live dockerd runs new containers with: its runtimes (name -> path), a space, its default (a JSON string:
# runtime names hold no spaces).
LIVE = ("docker", "info", "--format", "{{json .Runtimes}} {{json .DefaultRuntime}}")
# The containers that still run under a runtime (uninstall: the runtime's binary must outlive them).
RUNNING = ("docker", "ps", "-q", "--no-trunc")
INSPECT_RUNTIME = ("docker", "inspect", "--format", "{{.Name}} {{.HostConfig.Runtime}}")
# a container as the restart with live-restore must find it again: the same id, still running, started when it was
INSPECT_STATE = ("docker", "inspect", "--format", "{{.Id}} {{.State.Running}} {{.State.StartedAt}} {{.Name}}")
HOLD_INFO = ("docker", "info", "--format", "{{.LiveRestoreEnabled}} {{.Swarm.LocalNodeState}}")
# The operator's daemon.json while a run holds live-restore on for a restart (DockerEngine.restart_keeping): a run
# killed in between leaves it, and the next run puts the operator's live-restore back from it (finish_hold).
HOLD_STATE = f"{paths.STATE_DIR}/docker-live-restore.json"
# dockerd flags that have a daemon.json twin; both at once stops dockerd ("directives are specified both as a
# flag and in the configuration file").
FLAG_KEYS = {
    "-H": "hosts", "--host": "hosts", "--default-runtime": "default-runtime", "--add-runtime": "runtimes",
    "--data-root": "data-root", "-g": "graph", "--storage-driver": "storage-driver", "-s": "storage-driver",
    "--exec-opt": "exec-opts", "--log-driver": "log-driver", "--log-opt": "log-opts",
    "--insecure-registry": "insecure-registries", "--registry-mirror": "registry-mirrors",
    "--containerd": "containerd", "--dns": "dns", "--bip": "bip", "--mtu": "mtu", "--iptables": "iptables",
    "--cgroup-parent": "cgroup-parent", "--live-restore": "live-restore", "--debug": "debug", "-D": "debug",
}


@dataclass
class MergeResult:
    text: str  # the new file content (== old content when nothing changed)
    changes: list[Change] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.changes)


def parse(text: str, path: str = DAEMON_JSON) -> dict:
    """daemon.json as dockerd reads it, strictly (see base.load_json_strict), with the keys gpuprov touches typed
    the way dockerd wants them (dockerd refuses to start otherwise; we refuse to edit)."""
    if not text.strip():
        return {}
    doc = load_json_strict(text, path)
    if not isinstance(doc, dict):
        raise ConfigInvalid(f"{path} must hold a JSON object at the top level; the file was not changed")
    _check_types(doc, path)
    return doc


def _check_types(doc: dict, path: str) -> None:
    def bad(key: str, want: str):
        raise ConfigInvalid(f"{path}: \"{key}\" must be {want} (dockerd would refuse it too); fix it, then run "
                            "again (the file was not changed)")

    runtimes = doc.get("runtimes")
    if runtimes is not None:
        if not isinstance(runtimes, dict):
            bad("runtimes", "an object")
        for name, rt in runtimes.items():
            if not isinstance(rt, dict):
                bad(f"runtimes.{name}", "an object such as {\"path\": \"/usr/bin/runc\"}")
            if "path" in rt and not isinstance(rt["path"], str):
                bad(f"runtimes.{name}.path", "a string")
            args = rt.get("runtimeArgs")
            if args is not None and not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
                bad(f"runtimes.{name}.runtimeArgs", "a list of strings")
    if "default-runtime" in doc and not isinstance(doc["default-runtime"], str):
        bad("default-runtime", "a string")
    feats = doc.get("features")
    if feats is not None and not (isinstance(feats, dict) and all(isinstance(v, bool) for v in feats.values())):
        bad("features", "an object of true/false values")


# daemon.json keys the running dockerd applies on SIGHUP (Docker's "configuration reload behavior"); every other key
# is read at start only, so setting it (--engine-option) needs a restart (refused while it would stop containers,
# unless --restart-engine).
RELOADABLE = frozenset({"debug", "labels", "live-restore", "max-concurrent-downloads", "max-concurrent-uploads",
                        "max-download-attempts", "authorization-plugins", "insecure-registries", "registry-mirrors",
                        "shutdown-timeout"})


def merge(text: str, *, runtime_name: str = "nvidia", runtime_path: str, default: bool = False,
          cdi: bool = False, replace: bool = False, path: str = DAEMON_JSON,
          options: tuple[tuple[str, str], ...] = ()) -> MergeResult:
    """Add runtimes.<name>, optionally default-runtime and features.cdi. Existing keys keep their order and values.
    The operator's own settings are theirs: a runtime of that name pointing to another binary, or another
    default-runtime, raises RuntimeConflict (exit 14) unless `replace` (--replace-runtime); a replaced runtime gets
    a fresh entry (its runtimeArgs belonged to the other binary and are never carried over)."""
    doc = parse(text, path)
    changes = []
    runtimes = dict(doc.get("runtimes") or {})
    entry = runtimes.get(runtime_name)
    if entry is None or entry.get("path") != runtime_path:
        if entry is not None and not replace:
            theirs = entry.get("path") or entry.get("runtimeType") or "another runtime"
            args = f" with runtimeArgs {entry['runtimeArgs']}" if entry.get("runtimeArgs") else ""
            raise RuntimeConflict(
                f"{path}: runtime {runtime_name!r} is already registered as {theirs}{args}; gpuprov leaves it as it "
                f"is. Use another name (--runtime-name gpuprov), or pass --replace-runtime to point "
                f"{runtime_name!r} at {runtime_path} (its runtimeArgs are dropped); the file was not changed")
        runtimes[runtime_name] = {"path": runtime_path, "runtimeArgs": []}
        doc["runtimes"] = runtimes
        changes.append(Change(f"runtimes.{runtime_name}", runtime_path, reload=True))
    current = doc.get("default-runtime")
    if default and current != runtime_name:
        if current is not None and not replace:
            raise RuntimeConflict(
                f"{path}: default-runtime is {current!r}, set by you; gpuprov leaves it. Keep it (run without "
                f"--default, then use `docker run --runtime {runtime_name}`), or pass --replace-runtime to make "
                f"{runtime_name!r} the default; the file was not changed")
        doc["default-runtime"] = runtime_name
        changes.append(Change("default-runtime", runtime_name, reload=True))
    if cdi:
        feats = dict(doc.get("features") or {})
        if feats.get("cdi") is not True:
            feats["cdi"] = True
            doc["features"] = feats
            changes.append(Change("features.cdi", "true", reload=False))  # features are read at start only
    for key, value_json in options:  # the operator's own keys (--engine-option): set where they differ, in place
        value = json.loads(value_json)
        if key not in doc or doc[key] != value:
            doc[key] = value
            changes.append(Change(key, json.dumps(value), reload=key in RELOADABLE))
    if not changes:
        return MergeResult(text, [])
    return MergeResult(dump_json(doc, path), changes)


def unmerge(doc: dict, *, runtime_paths: tuple[str, ...], old: dict | None = None, written: dict | None = None,
            later: tuple[dict, ...] = ()) -> list[Change]:
    """Take gpuprov's keys out of `doc` (in place); the changes made. gpuprov's runtimes are those whose path is one
    of gpuprov's runtimes; a default-runtime naming one of them is gpuprov's too. `old` (the file before gpuprov's first
    write, from the record; None: unknown) and `later` (the operator's files before gpuprov's later writes) give
    back what --replace-runtime replaced (the latest such entry); `old` tells whether the `runtimes`
    and `features` objects were the operator's, and, with `written` (gpuprov's last write), whether features.cdi
    was gpuprov's. Every other key, value and position stays as the operator has it now."""
    changes: list[Change] = []
    before = old or {}
    runtimes = doc.get("runtimes") if isinstance(doc.get("runtimes"), dict) else {}
    theirs: dict = {}
    for doc_then in (before, *later):  # the latest operator's entry of each name wins
        theirs.update({n: e for n, e in (doc_then.get("runtimes") or {}).items()
                       if isinstance(e, dict) and e.get("path") not in runtime_paths})
    ours = [n for n, e in runtimes.items() if isinstance(e, dict) and e.get("path") in runtime_paths]
    # dockerd's reload (SIGHUP) applies `runtimes` and `default-runtime` only when the file sets them: a key taken
    # out of the file keeps its old value in the running daemon (seen with docker.io 20.10). DockerEngine.reload_live
    # sets them for one more reload instead of restarting dockerd (which stops containers without live-restore).
    for name in ours:
        if name in theirs:
            runtimes[name] = copy.deepcopy(theirs[name])  # --replace-runtime took it: the operator's entry again
            changes.append(Change(f"runtimes.{name}", f"{theirs[name].get('path')} (yours again)"))
        else:
            del runtimes[name]
            changes.append(Change(f"runtimes.{name}", "removed"))
    if ours and not runtimes and "runtimes" not in before:
        del doc["runtimes"]
        changes.append(Change("runtimes", "removed"))
    default = doc.get("default-runtime")
    if default in ours and before.get("default-runtime") != default:
        if "default-runtime" in before:
            doc["default-runtime"] = before["default-runtime"]
        else:
            del doc["default-runtime"]
        changes.append(Change("default-runtime", before.get("default-runtime", "removed")))
    feats, theirs_feats = doc.get("features"), before.get("features") or {}
    ours_cdi = ((written or {}).get("features") or {}).get("cdi") is True and theirs_feats.get("cdi") is not True
    if old is not None and isinstance(feats, dict) and feats.get("cdi") is True and ours_cdi:
        if "cdi" in theirs_feats:
            feats["cdi"] = theirs_feats["cdi"]
        else:
            del feats["cdi"]
        if not feats and "features" not in before:
            del doc["features"]
        changes.append(Change("features.cdi", "yours again", reload=False))  # features are read at start only
    return changes


def unit_flags(root: Path = Path("/")) -> dict[str, str]:
    """daemon.json keys that dockerd also gets as flags from its unit -> where the flag is set. The command line is
    the unit's ExecStart (the last one, drop-ins included) with its $VARS expanded from the unit's Environment= and
    EnvironmentFile= as systemd expands them: Debian's docker.io runs `dockerd -H fd:// $DOCKER_OPTS` with
    `EnvironmentFile=-/etc/default/docker`, so a flag in DOCKER_OPTS is one dockerd gets."""
    files = [root / p.lstrip("/") for p in UNIT_FILES]
    dropins = root / DROPIN_DIR.lstrip("/")
    if dropins.is_dir():
        files += sorted(dropins.glob("*.conf"))
    execs: list[tuple[str, str]] = []  # (command line, the unit file it is in)
    inline: dict[str, tuple[str, str]] = {}  # Environment=: name -> (value, where)
    env_files: list[str] = []
    for f in files:
        try:
            text = read_text_file(f).replace("\\\n", " ")
        except OSError:
            continue
        for key, val in re.findall(r"^\s*(ExecStart|Environment|EnvironmentFile)\s*=[ \t]*(.*)$", text, re.M):
            if key == "ExecStart":
                execs[:] = [(val, str(f))] if val.strip() else []  # `ExecStart=` resets the command in drop-ins
            elif key == "EnvironmentFile":
                env_files[:] = [*env_files, val.strip()] if val.strip() else []
            elif not val.strip():
                inline.clear()
            else:
                inline.update({k: (v, str(f)) for k, v in _assignments(_words(val))})
    env = {**inline, **_env_files(root, env_files)}  # systemd: EnvironmentFile= wins over Environment=
    found: dict[str, str] = {}
    for line, unit in execs:
        for w, where in _expand(_words(line), env, unit):
            flag = w.split("=", 1)[0]
            if flag in FLAG_KEYS:
                found[FLAG_KEYS[flag]] = where
    return found


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def _assignments(words: list[str]) -> list[tuple[str, str]]:
    return [(k, v) for k, sep, v in (w.partition("=") for w in words) if sep and re.fullmatch(r"\w+", k)]


def _env_files(root: Path, names: list[str]) -> dict[str, tuple[str, str]]:
    """EnvironmentFile= lines' KEY=VALUE assignments (a leading `-`: the file may be missing), later files winning."""
    env: dict[str, tuple[str, str]] = {}
    for name in names:
        path = under(root, name.lstrip("-"))
        try:
            text = read_text_file(path)
        except OSError:
            continue
        for line in text.splitlines():
            if line.lstrip().startswith(("#", ";")):
                continue
            env.update({k: (v, str(path)) for k, v in _assignments(_words(line))})
    return env


VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")  # ${NAME} or $NAME in an ExecStart word


def _expand(words: list[str], env: dict[str, tuple[str, str]], unit: str) -> list[tuple[str, str]]:
    """ExecStart's words with systemd's expansion: a word that is only `$NAME` becomes the value's words, `${NAME}`
    (or `$NAME` inside a word) the value; each with where it was set."""
    out: list[tuple[str, str]] = []
    for w in words:
        bare = re.fullmatch(r"\$(\w+)", w)
        if bare:
            value, where = env.get(bare.group(1), ("", unit))
            out += [(v, f"{where} (${bare.group(1)}, which {unit} passes to dockerd)") for v in value.split()]
            continue
        names = [a or b for a, b in VAR.findall(w)]
        where = next((env[n][1] for n in names if n in env), unit)
        out.append((VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ("", ""))[0], w), where))
    return out


def conflicts(doc: dict, flags: dict[str, str]) -> list[str]:
    return [f"{k!r} is set in daemon.json and as a dockerd flag in {flags[k]}" for k in doc if k in flags]


def cdi_warning() -> list[str]:
    """CDI device names (`docker run --device nvidia.com/gpu=0`) need dockerd >= 25 (daemon.json features.cdi)."""
    exe = shutil.which("dockerd", path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin")
    if not exe:
        return []
    r = effects.try_run([exe, "--version"], timeout=10)
    out = r.stdout if r else ""
    try:
        major = int(out.split("version", 1)[1].strip().split(".", 1)[0])
    except (IndexError, ValueError):
        return []
    if major >= 25:
        return []
    return [f"dockerd {out.split('version', 1)[1].strip().split(',')[0]} has no CDI support (docker >= 25 reads "
            "features.cdi): `--device nvidia.com/gpu=…` works after an engine upgrade; --gpus works now"]


def keep_how(keeps: int) -> str:
    """The plan's words for DockerEngine.restart_keeping."""
    return (f"restart dockerd with live-restore on for the restart (your {keeps} running container(s) keep running), "
            "then live-restore back off by a reload")


HOOK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"  # where dockerd's LookPath finds the --gpus hook


class DockerEngine(Engine):
    restart_stops_containers = True  # unless live-restore (restart_stops counts them)
    name = "docker"
    title = "Docker"
    default_config = DAEMON_JSON
    daemon_names = ("dockerd",)
    pid_files = ("/run/docker.pid", "/var/run/docker.pid")
    unit = SPEC.unit
    ready_argv = ("docker", "info")
    lists_runtimes = True
    cgroup_prefixes = (("docker-", "docker"),)
    cgroup_parents = ("docker",)
    container_store = CONTAINERS
    reloadable_keys = RELOADABLE

    def packages(self, target, source: str) -> tuple[str, ...]:
        if source == "docker-ce":
            return ("docker-ce", "docker-ce-cli", "containerd.io")
        if target.family == "debian":
            return ("docker.io",)
        if target.os_id == "amzn":
            return ("docker",)
        return ("moby-engine",)  # Fedora-family Moby; EL proper ships no Docker (the default there is docker-ce)

    def default_source(self, target) -> str:
        return "docker-ce" if target.family == "rhel" and target.os_id != "amzn" else "distro"

    def listed_runtimes(self) -> list[str] | None:
        r = effects.try_run(list(RUNTIMES), timeout=20)
        if r is None or r.returncode != 0:
            return None
        try:
            return list(json.loads(r.stdout))
        except ValueError:
            return None

    def validation(self, runtime_name: str, runtime_path: str, gpu: bool) -> Validation:
        """The image imported from this host's files when missing, then run by the runtime's name."""
        image = ImageImport(validate.IMAGE, ("docker", "import", "-", validate.IMAGE),
                            present=("docker", "image", "inspect", validate.IMAGE))
        return Validation(image, tuple(ContainerRun(a) for a in validate.run_argvs(runtime_name, gpu)))

    def node_probe(self, run: Run) -> dict | None:
        rc, out, _ = run(list(RUNTIMES))
        try:
            doc = json.loads(out) if rc == 0 else None
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def node_runtime(self, run: Run, probe: object, name: str, runtime_path: str) -> tuple[str | None, str | None]:
        rts = probe if isinstance(probe, dict) else None
        if rts is None:
            return None, "cannot ask the engine (not running)"
        if name not in rts:
            return None, (f"runtime {name!r} is not registered in dockerd (has: {', '.join(rts)}): run gpuprov "
                          "engine configure docker")
        return (rts[name] or {}).get("path", ""), None

    def check_container_argv(self, cid: str, env: dict[str, str], argv: list[str], runtime_path: str, rootfs: str,
                             log: str) -> list[str]:
        envs = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
        return ["docker", "run", "--rm", "--pull", "never", "--runtime", "nvidia", *envs, validate.IMAGE, *argv]

    def prepare_check_image(self, rootfs: str) -> None:
        """The validation image, imported from this host's files when it is missing."""
        image = self.validation("nvidia", RUNTIME_PATH, False).image
        if effects.run(list(image.present or ()), check=False).returncode == 0:
            return
        effects.run(list(image.load), input_text=image.stdin(validate.BINARIES))

    # Debian's docker.io (bookworm's 20.10.24 and trixie's 26.1.5 alike): its prerm copies nuke-graph-directory.sh
    # into /var/lib/docker on `remove`, and its postrm runs it on `purge` ("Nuking /var/lib/docker": every
    # container, image and volume). Docker CE's, Moby's and Fedora's packages delete nothing there.
    data_root = DATA_ROOT
    data_packages = tuple(o.package for o in SPEC.packages)
    purge_deletes_data = ("docker.io",)

    def stored(self, root: Path) -> StoredData | None:
        """The live dockerd's containers, images and volumes where it answers and keeps them in DATA_ROOT; else
        its files there (a stopped dockerd, a --root tree)."""
        return (self._stored_live() if is_live(root) else None) or \
            docker_store(root, DATA_ROOT, repository(validate.IMAGE))

    def _stored_live(self) -> StoredData | None:
        r = effects.try_run(list(ROOT_DIR), timeout=20, probe=True)
        if r is None or r.returncode != 0 or r.stdout.strip() != DATA_ROOT:
            return None  # no dockerd, or one whose data lie elsewhere: the files under DATA_ROOT are what a purge hits
        got = [effects.try_run(list(a), timeout=60, probe=True) for a in (ALL_CONTAINERS, ALL_IMAGES, ALL_VOLUMES)]
        if any(g is None or g.returncode != 0 for g in got):
            return None
        ours = repository(validate.IMAGE)
        rows = [[ln.split("\t") for ln in g.stdout.splitlines() if ln.strip()] for g in got]  # type: ignore[union-attr]
        tags: dict[str, list[str]] = {}
        for image_id, ref, *_ in (r + [""] for r in rows[1]):
            tags.setdefault(image_id, []).extend([] if ref.startswith("<none>") else [ref])
        own = {i for i, t in tags.items() if t and all(repository(x) == ours for x in t)}
        images = sorted(", ".join(sorted(t)) if t else short(i) for i, t in tags.items() if i not in own)
        containers = sorted(name for name, image, *_ in (r + [""] for r in rows[0])
                            if repository(image) != ours and image not in own)
        return StoredData(DATA_ROOT, "the running dockerd", tuple(containers), tuple(images),
                          tuple(sorted(v[0] for v in rows[2])))

    def stored_container(self, cid: str) -> tuple[dict, str] | None:
        try:
            doc = json.loads(Path(f"{self.container_store}/{cid}/config.v2.json").read_text(errors="replace"))
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict):
            return {}, ""
        return (doc.get("Config") or {}).get("Labels") or {}, str(doc.get("Name", "")).lstrip("/")

    def plan(self, path: Path, req: RuntimeRequest, *, unit_root: Path = Path("/")) -> EnginePlan:
        old = read_config(path)
        m = merge(old or "", runtime_name=req.name, runtime_path=req.path, default=req.default, cdi=req.cdi,
                  replace=req.replace, path=str(path), options=req.options)
        warnings = []
        if m.changed:
            clashes = conflicts(parse(m.text, str(path)), unit_flags(unit_root))
            ours = [c for c in clashes if c.split("'")[1] in ("runtimes", "default-runtime", "features",
                                                               *(k for k, _ in req.options))]
            if ours:
                raise ConfigInvalid("; ".join(ours) + ": dockerd would refuse to start. Remove the flag where it "
                                    "is set (the unit: systemctl edit docker) or leave this key out; daemon.json was "
                                    "not changed")
            warnings = clashes
        if req.cdi:
            warnings += cdi_warning()
        return EnginePlan([FileEdit(path, old, m.text)] if m.changed else [], m.changes, warnings)

    def daemon_config(self, argv: list[str]) -> str:
        return flag_value(argv, SPEC.config_flags) or DAEMON_JSON

    def unplan(self, path: Path, entry: dict | None, *, root: Path = Path("/")) -> EnginePlan:
        """gpuprov's keys out of daemon.json (docker.unmerge). The operator's exact bytes where gpuprov's own line
        changes come out cleanly (base.undo_text) and give the same JSON; else the JSON written back (2-space)."""
        current = read_config(under(root, str(path)))
        if current is None:
            return EnginePlan([], [])
        doc = parse(current, str(path))
        rec = (entry or {}).get("files", {}).get(str(path))
        runtime_paths = (RUNTIME_PATH, *(entry or {}).get("runtime_paths", []))
        old = parse(rec["old"], str(path)) if rec and rec.get("old") else ({} if rec else None)
        changes = unmerge(doc, runtime_paths=runtime_paths, old=old,
                          written=parse(rec["written"], str(path)) if rec else None,
                          later=tuple(parse(t, str(path)) for t in (rec or {}).get("later", []) if t.strip()))
        if not changes:
            return EnginePlan([], [])
        if rec and rec.get("old") is None and not doc:  # gpuprov created the file and nothing else is in it
            return EnginePlan([], changes, removals=[path])
        text = undo_text(rec.get("old"), rec["written"], current) if rec else None
        if text is None or parse(text, str(path)) != doc:
            text = dump_json(doc, path)
        return EnginePlan([FileEdit(path, current, text)], changes)

    def apply_how(self, restart: bool, keeps: int = 0) -> str:
        if keeps:
            return keep_how(keeps)
        return "restart dockerd (a key taken out of daemon.json, or features: read at start only)" if restart else \
            "SIGHUP to dockerd (runtimes and default-runtime it sets reload live; containers keep running)"

    def pending_restart(self, daemon: Daemon, installing: bool = False, search: str = HOOK_PATH) -> str | None:
        """dockerd looks for the --gpus hook only at start-up: one that appeared later needs a restart, and so does
        one that is not there yet when `installing` (the plan: runtime.install puts it in before engine.config)."""
        hook = shutil.which("nvidia-container-runtime-hook", path=search)
        if daemon is None:  # the plan on a host whose dockerd this run installs: it starts before runtime.install
            return "dockerd looks for the --gpus hook this run installs only when it starts" \
                if installing and not hook else None
        if not daemon.in_our_mount_namespace():
            return None
        if not hook:
            return "dockerd looks for the --gpus hook this run installs only when it starts" if installing else None
        try:
            later = hook_present_since(hook) > daemon.started_at()
        except (OSError, StopIteration, ValueError, IndexError):
            return None
        return "dockerd started before its --gpus hook was installed and looks for it only when it starts" if later else None

    def apply(self, daemon: Daemon, plan: EnginePlan, *, restart: bool) -> str:
        """runtimes/default-runtime are live-reloadable (SIGHUP, running containers untouched); the rest needs a
        restart."""
        if restart or plan.needs_restart:
            return self.restart(daemon)
        os.kill(daemon.pid, signal.SIGHUP)
        return f"reloaded dockerd (SIGHUP to pid {daemon.pid})"

    live_argv = LIVE

    def restart_stops(self, daemon: Daemon) -> int:
        """The containers dockerd runs now, unless live-restore keeps them through a restart (`docker info`)."""
        if not daemon.in_our_mount_namespace():
            return 0  # its client would ask another daemon; nothing to count
        r = effects.try_run(["docker", "info", "--format", "{{.LiveRestoreEnabled}} {{.ContainersRunning}}"],
                            timeout=20)
        words = r.stdout.split() if r and r.returncode == 0 else []
        return int(words[1]) if len(words) == 2 and words[0] == "false" and words[1].isdigit() else 0

    def hold_blocker(self, daemon: Daemon) -> str | None:
        """Why live-restore cannot be turned on by a reload for a restart (None: it can). dockerd reloads
        `live-restore` on SIGHUP, but refuses it in swarm mode, and a --live-restore flag on its unit would clash with
        the key in daemon.json."""
        if not daemon.in_our_mount_namespace():
            return "its dockerd runs in another mount namespace"
        r = effects.try_run(list(HOLD_INFO), timeout=20)
        words = r.stdout.split() if r and r.returncode == 0 else []
        if len(words) != 2:
            return "`docker info` did not answer"
        if words[1] not in ("inactive", ""):
            return f"dockerd is in swarm mode ({words[1]}), where live-restore is refused"
        if "live-restore" in unit_flags():
            return "its unit sets --live-restore"
        return None

    def running(self) -> dict[str, tuple[str, str]] | None:
        """The running containers: id -> (name, started at); None: no answer."""
        r = effects.try_run(list(RUNNING), timeout=20)
        if r is None or r.returncode != 0:
            return None
        ids = r.stdout.split()
        if not ids:
            return {}
        r = effects.try_run([*INSPECT_STATE, *ids], timeout=30)
        if r is None or r.returncode != 0:
            return None
        out = {}
        for ln in r.stdout.splitlines():
            w = ln.split()
            if len(w) == 4 and w[1] == "true":
                out[w[0]] = (w[3].lstrip("/"), w[2])
        return out

    def live_restore(self) -> bool | None:
        r = effects.try_run(list(HOLD_INFO), timeout=20)
        words = r.stdout.split() if r and r.returncode == 0 else []
        return {"true": True, "false": False}.get(words[0]) if words else None

    def held(self, path: Path) -> dict | None:
        """The hold a killed run left for `path` (HOLD_STATE): {"config", "final", "temp"}; None: none."""
        try:
            data = read_trusted(HOLD_STATE)
            doc = json.loads(data) if data else None
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("config") != str(path) or not isinstance(doc.get("temp"), str) \
                or not isinstance(doc.get("final"), str):
            return None
        return doc

    def finish_hold(self, daemon: Daemon | None, path: Path) -> str | None:
        """A run killed while it held live-restore on (restart_keeping): the operator's daemon.json as that run
        meant to leave it (gpuprov's keys, the operator's live-restore), and a reload. A file the operator saved
        since is theirs: only the state goes."""
        hold = self.held(path)
        if hold is None:
            return None
        final = hold["final"]
        if read_config(path) not in (hold["temp"], self._unheld(parse(final, str(path)), path)):
            Path(HOLD_STATE).unlink(missing_ok=True)  # saved since by the operator (or never held): theirs
            return None
        self._put_back(daemon.pid if daemon else None, path, final)
        return f"live-restore put back as {path} had it (a run stopped while it held it on), by a reload"

    def restart_keeping(self, daemon: Daemon, path: Path) -> str:
        """The restart the --gpus hook needs, without stopping a container: live-restore turned on by a reload
        (daemon.json with the key set true, SIGHUP, `docker info` shows it), dockerd restarted, every container
        that ran found running again (same id, same start time), then the file as it was (the operator's bytes and
        mode: gpuprov's keys, their live-restore or none) and a reload. The held file is in HOLD_STATE until then,
        so that a killed run's successor puts it back (finish_hold)."""
        before = self.running() or {}
        final = read_config(path) or "{}\n"
        doc = parse(final, str(path))
        temp = dump_json({**doc, "live-restore": True}, path)
        write_file(HOLD_STATE, json.dumps({"config": str(path), "final": final, "temp": temp}), mode=0o600,
                   keep_mode=False, backup=False)
        write_file(path, temp, backup=False)
        os.kill(daemon.pid, signal.SIGHUP)
        if not effects.wait_for(lambda: self.live_restore() is True, 20):
            self._put_back(daemon.pid, path, final)
            names = ", ".join(sorted(n for n, _ in before.values()))
            raise RestartRefused(f"dockerd did not turn live-restore on after a reload, and restarting it stops its "
                                 f"{len(before)} running container(s) ({names}); {path} has gpuprov's runtime but "
                                 f"dockerd was not restarted: run again with --restart-engine to restart it anyway")
        how = self.restart(daemon)
        new = self.live_daemon(path)
        after = self.running() or {}
        lost = sorted(n for cid, (n, started) in before.items() if after.get(cid) != (n, started))
        self._put_back(new.pid if new else None, path, final)
        if lost:
            raise StepFailed(f"after `{how}` with live-restore on, these containers no longer run as before: "
                             f"{', '.join(lost)}")
        back = "on" if doc.get("live-restore") is True else "off"
        return (f"{how} with live-restore on for the restart ({len(before)} running container(s) kept: "
                f"{', '.join(sorted(n for n, _ in before.values()))}), then live-restore back {back} by a reload")

    def _put_back(self, pid: int | None, path: Path, final: str) -> None:
        """`final` written back and dockerd's live-restore made what it says. dockerd's reload applies
        `live-restore` only where the file sets it (as `runtimes`: reload_live), so where `final` has no such key the
        file says false for one reload first, then is written back as it was."""
        doc = parse(final, str(path))
        want = doc.get("live-restore") is True
        if pid is not None:
            write_file(path, final if "live-restore" in doc else self._unheld(doc, path), backup=False)
            os.kill(pid, signal.SIGHUP)
            ok = effects.wait_for(lambda: self.live_restore() is want, 20)
        write_file(path, final, backup=False)
        Path(HOLD_STATE).unlink(missing_ok=True)
        if pid is not None and not ok:
            raise StepFailed(f"dockerd (pid {pid}) still has live-restore {'off' if want else 'on'} after a reload "
                             f"of {path}; reload it (systemctl reload docker) to put your setting back")

    @staticmethod
    def _unheld(doc: dict, path: Path) -> str:
        """The file of the reload that turns a held live-restore off where the operator's file has no such key."""
        return dump_json({**doc, "live-restore": False}, path)

    def live(self) -> tuple[dict[str, str], str] | None:
        """(runtime name -> path, default runtime) as the live dockerd reports them (`docker info`); None: no
        answer."""
        r = effects.try_run(list(LIVE), timeout=20)
        try:
            rts, _, default = r.stdout.strip().rpartition(" ") if r and r.returncode == 0 else (None, "", None)
            return {n: (e or {}).get("path", "") for n, e in json.loads(rts).items()}, json.loads(default)
        except (TypeError, ValueError, AttributeError):
            return None

    def stale(self, path: Path, runtime_paths: tuple[str, ...]) -> list[str] | None:
        """What the live dockerd that reads `path` still has of gpuprov's that the file no longer says: a runtime
        whose path is one of `runtime_paths` and that the file does not register, a default the file does not set
        (dockerd's reload keeps a key taken out of the file). [] when it agrees; None: cannot tell."""
        live = self.live()
        if live is None:
            return None
        rts, default = live
        doc = parse(read_config(path) or "", str(path))
        mine = doc.get("runtimes") if isinstance(doc.get("runtimes"), dict) else {}
        out = [f"runtime {n}" for n, p in rts.items() if p in runtime_paths and n not in mine]
        want = doc.get("default-runtime") or "runc"
        if default != want and "default-runtime" not in unit_flags():
            out.append(f"default runtime {default}")
        return out

    def reload_live(self, daemon: Daemon, path: Path, runtime_paths: tuple[str, ...]) -> str:
        """SIGHUP; then, where the daemon still names what the file no longer says (stale: dockerd's reload applies
        `runtimes` and `default-runtime` only when the file sets them), the file once more with those keys set to
        what remains (`runtimes` as in the file or {}, `default-runtime` runc), SIGHUP again, and the file written
        back as it was. Running containers are never touched: no restart."""
        os.kill(daemon.pid, signal.SIGHUP)
        done = f"reloaded dockerd (SIGHUP to pid {daemon.pid}; running containers untouched)"
        if not daemon.in_our_mount_namespace():
            return done  # `docker info` would ask another daemon
        if effects.wait_for(lambda: self.stale(path, runtime_paths) == [], 3):
            return done
        text = read_config(path) or ""
        doc = parse(text or "{}", str(path))
        keys = {"runtimes": doc.get("runtimes") or {}}
        if "default-runtime" not in unit_flags():
            keys["default-runtime"] = doc.get("default-runtime") or "runc"
        write_file(path, dump_json({**doc, **keys}, path), backup=False)
        try:
            os.kill(daemon.pid, signal.SIGHUP)
            ok = effects.wait_for(lambda: self.stale(path, runtime_paths) == [], 30)
        finally:
            if text:
                write_file(path, text, backup=False)
            else:
                os.unlink(path)
        if not ok:
            raise StepFailed(f"dockerd (pid {daemon.pid}) still names {', '.join(self.stale(path, runtime_paths) or [])}"
                             f" after two reloads; restart it (systemctl restart docker) once its containers may stop")
        return done + f"; {', '.join(keys)} set for one more reload and {path} written back"

    def users(self, names: tuple[str, ...]) -> list[str] | None:
        """The running containers whose runtime is one of `names` (`docker inspect`); None: no answer."""
        r = effects.try_run(list(RUNNING), timeout=20)
        if r is None or r.returncode != 0:
            return None
        ids = r.stdout.split()
        if not ids:
            return []
        r = effects.try_run([*INSPECT_RUNTIME, *ids], timeout=30)
        if r is None or r.returncode != 0:
            return None
        return [ln.split()[0].lstrip("/") for ln in r.stdout.splitlines() if len(ln.split()) == 2
                and ln.split()[1] in names]

    def restart(self, daemon: Daemon) -> str:
        """Through the unit that runs it (the packages' docker.service, the snap's), else the same way as before
        for the default config (the init script, or the daemon in the background); a dockerd started by hand with
        its own config (static binaries, --config-file) is started again exactly as it ran."""
        for unit in (SPEC.unit, SPEC.snap_unit):
            if unit and daemon.is_unit(unit):
                effects.restart_unit(unit)
                if not effects.wait_for(self.answers, 60):
                    raise StepFailed(f"dockerd did not come up after `systemctl restart {unit}`; see "
                                     f"`journalctl -u {unit}`")
                return f"systemctl restart {unit}"
        if daemon.config != DAEMON_JSON and daemon.in_our_mount_namespace():
            return effects.respawn(daemon.pid, daemon.argv, "dockerd", self.answers)
        return self.restart_in_place(daemon.pid)

    def restart_in_place(self, pid: int) -> str:
        """A full restart (dockerd registers the --gpus device driver only at start, when it finds the hook) of the
        default config's dockerd: its unit where systemd runs, else stopped and started the way bootstrap starts it."""
        if effects.has_systemd():
            effects.restart_unit(self.unit)
            return f"systemctl restart {self.unit}"
        effects.stop(pid, self.daemon)
        return "restarted dockerd: " + effects.start_daemon(self.unit, self.daemon, self.ready_argv)

    def verify(self, daemon: Daemon, req: RuntimeRequest, *, wait: bool = True) -> bool | None:
        if not daemon.in_our_mount_namespace():
            return None  # `docker info` would ask another daemon (ours is in a container)
        if not wait:
            rts = self.listed_runtimes()
            return None if rts is None else req.name in rts
        return effects.wait_for(lambda: req.name in (self.listed_runtimes() or []), 30)

