"""The node checks. Each takes a host adapter (local commands, or testinfra's `host`) and returns a CheckResult;
a failure says what is wrong on that host in one line.

The engine is the first whose daemon answers on the node, in the adapters' order (engines.ADAPTERS: dockerd's
`docker info`, else containerd's `ctr version`, else `podman info`, which has no daemon); what is asked of it is its
adapter's (node_probe, node_runtime, check_container_argv, check_route, prepare_check_image, cri_handler). Podman's
check containers get the GPU through CDI (`--device nvidia.com/gpu=all`). Container checks never reach a registry:
the check image is built on the node from its own files (`gpuprov verify --prepare`, the same image bootstrap's
validation step imports), docker runs it with `--pull never`, containerd runs it as a plain rootfs (`ctr run
--rootfs`) through the runtime binary (`--runc-binary`)."""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import asdict, dataclass
from functools import cached_property

from provision import effects, engines
from provision.decide.kernel import PIN_FILE
from provision.engines.base import Engine
from provision.errors import GpuprovError, StepFailed
from provision.facts.boot import BOOT_PIN, read_pin_text
from provision.inject.edits import mismatch  # the runtime refuses with the same line
from provision.k8s.labels import NFD_FILE
from provision.paths import DKMS_FAILED, INSTALL_RECORD

RUNTIME_PATH = "/usr/local/bin/gpuprov-runtime"
# Fixed paths, not provision/paths.py's: through testinfra the controller names these for a node, and the node's
# `gpuprov verify --prepare` must find the same ones whatever GPUPROV_STATE_DIR/GPUPROV_RUN_DIR the controller has.
ROOTFS = "/var/lib/gpuprov/verify/rootfs"  # containerd's check container: the image's files, unpacked
# containerd's check container writes its output here (ctr run --log-uri; plan/steps.RunContainer says why)
LOG_DIR = "/run/gpuprov"
OK_WORD = "gpuprov-verify-ok"
NO_GPU = "no NVIDIA GPU on this host"


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skip | warn (the node works, but a risk is named: exit 0)
    detail: str

    def to_dict(self) -> dict:
        return asdict(self)


class NodeHost:
    """What the checks need from a host: run a command (an argv: nothing goes through a shell). Facts come from
    `gpuprov detect --json` on that host."""

    runtime_path = RUNTIME_PATH  # what containerd's check container runs as its runc (docker: its registration)
    rootfs = ROOTFS
    log_dir = LOG_DIR

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        raise NotImplementedError

    def has_command(self, name: str) -> bool:
        """`name` is on the host's PATH (the shell's own lookup, the name passed as an argument, never parsed)."""
        return self.run(["sh", "-c", 'command -v "$1"', "sh", name])[0] == 0

    def json_of(self, cmd: list[str]) -> dict | None:
        """A command's JSON output, or None when it fails or prints something else."""
        rc, out, _ = self.run(cmd)
        try:
            return json.loads(out) if rc == 0 else None
        except ValueError:
            return None

    def prepare(self, engine: str) -> str | None:
        """Build the check image from the node's own files; None when done, else why it could not be."""
        rc, out, err = self.run(["gpuprov", "verify", "--prepare", engine])
        return None if rc == 0 else ((err or out).strip().splitlines() or [f"exit {rc}"])[-1]

    gpuprov = ("gpuprov",)  # how this host's gpuprov is run (on a node reached through testinfra: from its PATH)

    @cached_property
    def facts(self) -> dict | None:
        return self.json_of([*self.gpuprov, "detect", "--json"])

    @cached_property
    def set_up_for(self) -> list[Engine]:
        """The engines this node is set up for: those whose config registers gpuprov's runtime (detect's facts: the
        host's configuration, what bootstrap and `engine configure` wrote). Empty when none says so."""
        names = {e.get("name") for e in (self.facts or {}).get("engines") or []
                 if "nvidia" in (e.get("runtimes") or []) or e.get("default_runtime") == "nvidia"}
        return [eng for eng in engines.every() if eng.name in names]

    @cached_property
    def engine(self) -> Engine | None:
        """The engine to check: the first one this node is set up for whose daemon answers; on a node set up for
        none, the first whose daemon answers, in the adapters' order (None: none does). Another engine answering
        does not stand in for the one the node is set up for (docker.io brings containerd as its backend)."""
        for eng in self.set_up_for or engines.every():
            probe = eng.node_probe(self.run)
            if probe is not None:
                self.__dict__["probe"] = probe  # what it answered: kept, not asked again
                return eng
        return None

    @cached_property
    def probe(self) -> object | None:
        """What the engine's daemon answered (its adapter's node_probe), for node_runtime."""
        return self.engine.node_probe(self.run) if self.engine else None


class LocalHost(NodeHost):
    gpuprov = (sys.executable, "-m", "provision")  # the gpuprov running verify (a venv need not be on PATH)

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        try:
            r = effects.run(argv, check=False, timeout=120)
        except StepFailed as exc:  # not found, or still running after 120 s
            return 127, "", str(exc)
        return r.returncode, r.stdout, r.stderr

    def prepare(self, engine: str) -> str | None:
        try:
            prepare_image(engine, self.rootfs)
        except GpuprovError as exc:
            return str(exc)
        return None


class TestinfraHost(NodeHost):
    __test__ = False  # not a pytest test class

    def __init__(self, host):
        self.host = host

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        r = self.host.run(shlex.join(argv))  # testinfra takes a command line: each word quoted
        return r.rc, r.stdout, r.stderr


def prepare_image(engine: str, rootfs: str = ROOTFS) -> None:
    """On this host: the check image for `engine`, from this host's own files (no registry)."""
    engines.get(engine).prepare_check_image(rootfs)


def _gpus(h: NodeHost) -> list:
    return (h.facts or {}).get("gpus") or []


def _skip_without_gpu(name: str, h: NodeHost) -> CheckResult | None:
    return None if _gpus(h) else CheckResult(name, "skip", NO_GPU)


def _driver(h: NodeHost) -> dict:
    return (h.facts or {}).get("driver") or {}


def gpuprov_installed(h: NodeHost) -> CheckResult:
    if h.facts is None:
        return CheckResult("gpuprov installed", "fail", "`gpuprov detect --json` does not run on this host: "
                           "run the gpuprov role (or install.sh) first")
    return CheckResult("gpuprov installed", "pass", f"target {h.facts.get('target')}")


def driver_loaded(h: NodeHost) -> CheckResult:
    drv = _driver(h)
    return loaded_result(bool(_gpus(h)), bool(drv.get("loaded")), drv.get("version"), drv.get("kernel_module"))


def loaded_result(gpus: bool, loaded: bool, version: str | None, module: str | None) -> CheckResult:
    """driver_loaded from typed facts (bootstrap's resume reads them from this host's HostReport)."""
    if not gpus:
        return CheckResult("driver loaded", "skip", NO_GPU)
    if not loaded:
        return CheckResult("driver loaded", "fail", "NVIDIA GPU present but no driver loaded: gpuprov bootstrap, "
                           "then reboot if it asks")
    return CheckResult("driver loaded", "pass", f"{version} ({module} module)")


def versions_coherent(h: NodeHost) -> CheckResult:
    drv = _driver(h)
    return coherent_result(bool(_gpus(h)), drv.get("version"), drv.get("userspace_version"))


def coherent_result(gpus: bool, k: str | None, u: str | None) -> CheckResult:
    """versions_coherent from typed facts: the loaded module's version against the userspace's."""
    if not gpus:
        return CheckResult("driver versions coherent", "skip", NO_GPU)
    if not k or not u or k != u:
        return CheckResult("driver versions coherent", "fail", mismatch(k, u))
    return CheckResult("driver versions coherent", "pass", f"kernel module = userspace = {k}")


def dev_char_links(h: NodeHost) -> CheckResult:
    """Every NVIDIA device node has its /dev/char/MAJ:MIN link (inject/devchar.py says why)."""
    rc, out, err = h.run(["gpuprov", "runtime", "dev-char-links", "--check", "--json"])
    try:
        doc = json.loads(out)
    except ValueError:
        why = ((err or out).strip().splitlines() or [f"exit {rc}"])[-1]
        return CheckResult(DEV_CHAR, "fail", f"`gpuprov runtime dev-char-links --check` failed: {why}")
    return dev_char_result(doc)


DEV_CHAR = "/dev/char links"


def dev_char_result(doc: dict) -> CheckResult:
    """dev_char_links from `gpuprov runtime dev-char-links --check --json`'s answer."""
    missing, other, ok = doc.get("missing") or [], doc.get("other") or [], doc.get("ok") or []
    if not (missing or other or ok):
        return CheckResult(DEV_CHAR, "skip", "no NVIDIA device nodes in /dev")
    if missing or other:
        bad = ", ".join(missing + [f"{p} (taken by something else)" for p in other])
        return CheckResult(DEV_CHAR, "fail", f"no link for NVIDIA's node at {bad}: containers under the systemd "
                           "cgroup driver lose these devices at `systemctl daemon-reload`. Fix: `gpuprov runtime "
                           "dev-char-links` (and `systemctl enable gpuprov-dev-char.service`, which `gpuprov runtime "
                           "install` installs, for every boot)")
    return CheckResult(DEV_CHAR, "pass", f"{len(ok)} NVIDIA device nodes linked")


def persistence_mode(h: NodeHost) -> CheckResult:
    """Each GPU's persistence mode as the driver reports it (nvidia-smi asks NVML); reported, not judged: a node
    may run without it (bootstrap enables nvidia-persistenced on data-centre GPUs, plan/persistence.py)."""
    skip = _skip_without_gpu(PERSISTENCE, h)
    if skip:
        return skip
    rc, out, _ = h.run(["nvidia-smi", "--query-gpu=persistence_mode", "--format=csv,noheader"]) \
        if h.has_command("nvidia-smi") else (127, "", "")
    return persistence_result(out if rc == 0 else None)


PERSISTENCE = "persistence mode"


def persistence_result(out: str | None) -> CheckResult:
    """persistence_mode from nvidia-smi's answer (None: it is not there or failed)."""
    modes = [ln.strip() for ln in (out or "").splitlines() if ln.strip()]
    if not modes or any(m not in ("Enabled", "Disabled") for m in modes):
        return CheckResult(PERSISTENCE, "skip", "unknown (nvidia-smi did not answer)")
    if all(m == "Enabled" for m in modes):
        return CheckResult(PERSISTENCE, "pass", f"Enabled on {len(modes)} GPU(s)")
    off = [str(i) for i, m in enumerate(modes) if m == "Disabled"]
    return CheckResult(PERSISTENCE, "skip", f"Disabled on GPU {', '.join(off)} of {len(modes)}: GPU state is torn down "
                       "between clients (slow container starts); `systemctl enable --now nvidia-persistenced`, which "
                       "bootstrap does on data-centre GPUs")


def next_boot_module(h: NodeHost) -> CheckResult:
    """The kernel the next boot starts has an NVIDIA module: a kernel update that arrived without one (no headers
    for DKMS, no precompiled package) boots a GPU node without its driver. Checked wherever a GPU or a driver is."""
    name = "next-boot kernel module"
    drv = _driver(h)
    # a driver is there when it is loaded, its userspace found, or a kernel has its module (Debian keeps the
    # versioned libraries under nvidia/current/, where the userspace probe does not look)
    if not _gpus(h) and not drv.get("userspace_version") and not drv.get("loaded") and \
            not drv.get("module_kernels"):
        return CheckResult(name, "skip", "no NVIDIA GPU and no NVIDIA driver on this host")
    k, source = drv.get("next_boot_kernel"), drv.get("next_boot_from") or "?"
    if not k:
        return CheckResult(name, "skip", "no installed kernel found (no GRUB default, /vmlinuz or /boot/vmlinuz-*): "
                           "nothing to check")
    if drv.get("next_boot_module"):
        return CheckResult(name, "pass", f"{k} boots next ({source}) and has {drv['next_boot_module']}")
    # the DKMS hook guard's record (plan/driver.py: the kernel-hook step): the kernel installed, its build failed
    rc, record, _ = h.run(["cat", f"{DKMS_FAILED}/{k}"])
    failed = (f"; DKMS could not build it when the kernel was installed ({record.strip()})"
              if rc == 0 and record.strip() else "")
    return CheckResult(name, "fail", f"kernel {k} boots next ({source}) and has no NVIDIA module{failed}: after the "
                       f"reboot the GPU has no driver. Fix: run `gpuprov bootstrap` before rebooting (it installs that "
                       f"kernel's headers and builds the module, updating the driver within its branch where the "
                       f"archive has a version that builds: dkms autoinstall -k {k})")


def boot_default(h: NodeHost) -> CheckResult:
    """The default boot entry gpuprov keeps on a kernel with an NVIDIA module while the kernel that would boot next
    has none DKMS could build (plan/boot_default.py: its drop-in, or grub-set-default recorded in gpuprov's record).
    A warning, not a failure: the node boots with its driver, on an older kernel than the distribution's."""
    name = "default boot entry"
    rc, text, _ = h.run(["cat", BOOT_PIN])
    pin = read_pin_text(text) if rc == 0 else None
    how = f"{BOOT_PIN} sets GRUB_DEFAULT"
    if pin is None:
        rc, text, _ = h.run(["cat", INSTALL_RECORD])
        try:
            boot = json.loads(text).get("boot") if rc == 0 else None
        except (ValueError, AttributeError):
            boot = None
        if isinstance(boot, dict) and boot.get("kernel") and boot.get("unserved"):
            pin, how = read_pin_text(f"# Written by gpuprov\n# gpuprov-boot-pin: kernel={boot['kernel']} "
                                     f"unserved={boot['unserved']}\n"), "grub-set-default, GRUB_DEFAULT=saved"
    if pin is None:
        return CheckResult(name, "skip", "the distribution's (gpuprov keeps none: it does only while the kernel "
                           "that would boot next has no NVIDIA module DKMS could build)")
    return CheckResult(name, "warn", f"kept on {pin.kernel} by gpuprov ({how}): kernel {pin.unserved} has no "
                       f"NVIDIA module (DKMS could not build it), so the node boots {pin.kernel} until it has one. "
                       f"Fix: make the module build for {pin.unserved} (its headers; dkms autoinstall -k "
                       f"{pin.unserved}), or wait for the distribution's precompiled modules, then run `gpuprov "
                       "bootstrap`: it gives the default entry back")


def driver_updates(h: NodeHost) -> CheckResult:
    """The driver gpuprov pinned can take its distribution's updates (Debian): the security suite's entry carries the
    component the driver lives in (without it apt fetches the security kernel but never the driver's update, whose
    module the kernel may need), and the pin can move (a rollback pins the series at exactly the versions that worked,
    until an update builds). A warning, not a failure: the node runs; it will not follow the next security fix."""
    name = "driver updates reach the node"
    rc, pins, _ = h.run(["cat", PIN_FILE])
    if rc != 0:
        return CheckResult(name, "skip", "no driver series pinned by gpuprov (Debian/Ubuntu apt hosts)")
    rc, out, _ = h.run(["ls", "-1", "/var/lib/apt/lists"])
    lists = out.split() if rc == 0 else []
    security = sorted({m.group(1) for n in lists if (m := re.search(r"_dists_([^_]+-security)_", n))})
    lacking = [s for s in security if not any(f"_dists_{s}_non-free_binary-" in n for n in lists)]
    exact = sorted({v for v in re.findall(r"^Pin: version (\S+)$", pins, re.M) if v != "*" and not v.endswith(".*")})
    why = ([f"apt fetches {', '.join(lacking)} without non-free: the driver's security updates (and the module a "
            "security kernel needs) never reach this node"] if lacking else []) + \
        ([f"the driver is pinned at exactly {', '.join(exact)} (kept after an update that did not build): no update "
          "reaches it until one builds"] if exact else [])
    if why:
        return CheckResult(name, "warn", "; ".join(why) + ". Fix: run `gpuprov bootstrap` (it enables non-free on the "
                           "security entry and moves the series to the update within its branch)")
    return CheckResult(name, "pass", "the driver's pin follows its branch" + (
        f" and {', '.join(security)} carries non-free" if security else ""))


def engine_running(h: NodeHost) -> CheckResult:
    if h.engine is None and h.set_up_for:
        eng = h.set_up_for[0]
        ask = " ".join(eng.ready_argv) or f"{eng.name} info"
        fix = f"start it: systemctl start {eng.unit}" if eng.unit else f"see why `{ask}` fails"
        return CheckResult("engine running", "fail", f"this node is set up for {eng.title} (its config registers "
                           f"runtime 'nvidia'), and `{ask}` does not reach it: {fix}")
    if h.engine is None:
        return CheckResult("engine running", "fail", "neither `docker info` nor `ctr version` reaches a daemon, and "
                           "`podman info` fails: the engine is not running or not installed (gpuprov bootstrap "
                           "starts it)")
    return CheckResult("engine running", "pass", f"{h.engine.daemon} answers")


def runtime_registered(h: NodeHost, name: str = "nvidia") -> CheckResult:
    if h.engine is None:
        return CheckResult("runtime registered", "fail", "cannot ask the engine (not running)")
    path, why = h.engine.node_runtime(h.run, h.probe, name, h.engine.front_end(h.runtime_path))
    if path is None:
        return CheckResult("runtime registered", "fail", why or "")
    rc, _, _ = h.run(["test", "-x", path])
    if rc != 0:
        return CheckResult("runtime registered", "fail", f"runtime {name!r} points to {path}, which is missing or "
                           "not executable: run gpuprov runtime install")
    return CheckResult("runtime registered", "pass", f"{name} -> {path}")


def _container(h: NodeHost, name: str, env: dict[str, str], argv: list[str]) -> tuple[CheckResult | None, str]:
    if h.engine is None:
        return CheckResult(name, "fail", "no engine answers (see `engine running`)"), ""
    why = h.prepare(h.engine.name)
    if why:
        return CheckResult(name, "fail", f"could not build the check image from this host's files: {why}"), ""
    cid = f"gpuprov-verify-{os.getpid()}"
    log = f"{h.log_dir}/{cid}.log" if h.engine.check_log else ""
    if log:
        h.run(["rm", "-f", log])  # the shim appends
    rc, out, err = h.run(h.engine.check_container_argv(cid, env, argv, h.runtime_path, h.rootfs, log))
    if log:
        out = h.run(["cat", log])[1] + out
        h.run(["rm", "-f", log])
    if rc != 0:
        last = (err or out).strip().splitlines()
        return CheckResult(name, "fail", f"a container through {h.engine.check_route()} failed: "
                           f"{last[-1] if last else f'exit {rc}'}"), out
    return None, out


def plain_container(h: NodeHost) -> CheckResult:
    name = "container through the runtime"
    bad, out = _container(h, name, {}, ["sh", "-c", f"echo {OK_WORD}"])
    if bad:
        return bad
    if OK_WORD not in out:
        return CheckResult(name, "fail", f"the container ran but printed {out.strip()[-100:]!r}")
    return CheckResult(name, "pass", f"a plain container starts through {h.engine.check_route()}")


def gpu_container(h: NodeHost) -> CheckResult:
    name = "GPU container"
    skip = _skip_without_gpu(name, h)
    if skip:
        return skip
    bad, out = _container(h, name, {"NVIDIA_VISIBLE_DEVICES": "all"}, ["nvidia-smi", "-L"])
    if bad:
        return bad
    if "GPU 0" not in out:
        return CheckResult(name, "fail", f"nvidia-smi -L in a container printed no GPU: {out.strip()[-200:]}")
    return CheckResult(name, "pass", out.strip().splitlines()[0])


def cri_handler(h: NodeHost, name: str = "nvidia") -> CheckResult:
    """Kubernetes nodes (`gpuprov k8s node`): a CRI engine's handler `nvidia` (containerd's merged config, drop-ins
    included, or CRI-O's drop-in: its adapter's cri_handler), and the GPU labels file for NFD is there."""

    if h.engine is not None and not h.engine.serves_cri and not h.has_command("kubelet"):
        # docker.io brings containerd as dockerd's backend: that containerd serves no CRI clients here
        return CheckResult("CRI handler", "skip", f"a {h.engine.title} node without kubelet: no CRI handler to check")
    for eng in engines.every():
        found = eng.cri_handler(h.run, h.has_command, name) if eng.serves_cri else None
        if found is not None:
            break
    else:
        return CheckResult("CRI handler", "skip", "no containerd or CRI-O on this host")
    status, where = found
    if status == "fail":
        return CheckResult("CRI handler", "fail", where)
    labels = "labels for NFD" if h.run(["test", "-s", NFD_FILE])[0] == 0 else "no NFD labels file (gpuprov k8s labels --write)"
    return CheckResult("CRI handler", "pass", f"{where} handler {name!r}; {labels}")


def mig_result(modes: str, listing: str) -> CheckResult:
    """Which GPUs are in MIG mode and how many MIG devices each has, from `nvidia-smi --query-gpu=index,
    mig.mode.current --format=csv,noheader` and `nvidia-smi -L` (its indented `MIG …` lines under each GPU).
    Information, never a failure: a GPU without MIG says `[N/A]`, one with MIG and no instance is legal."""
    count: dict[str, int] = {}
    gpu = None
    for line in listing.splitlines():
        if line.startswith("GPU "):
            gpu = line.split(":", 1)[0].split()[1]
            count[gpu] = 0
        elif line.strip().startswith("MIG ") and gpu is not None:
            count[gpu] += 1
    parts, on = [], 0
    for line in modes.splitlines():
        idx, _, mode = (x.strip() for x in line.partition(","))
        if not idx.isdigit():
            continue
        if mode == "Enabled":
            on += 1
            parts.append(f"GPU {idx}: MIG enabled, {count.get(idx, 0)} MIG device(s)")
        else:
            parts.append(f"GPU {idx}: MIG {'disabled' if mode == 'Disabled' else 'not supported'}")
    if not parts:
        return CheckResult("MIG", "skip", "nvidia-smi reported no GPU")
    return CheckResult("MIG", "pass", f"{on} of {len(parts)} GPU(s) in MIG mode: " + "; ".join(parts))


def mig_mode(h: NodeHost) -> CheckResult:
    skip = _skip_without_gpu("MIG", h)
    if skip:
        return skip
    rc, modes, err = h.run(["nvidia-smi", "--query-gpu=index,mig.mode.current", "--format=csv,noheader"])
    if rc != 0:
        return CheckResult("MIG", "skip", f"nvidia-smi could not say: {(err or modes).strip()[-150:]}")
    return mig_result(modes, h.run(["nvidia-smi", "-L"])[1])


CHECKS = (gpuprov_installed, driver_loaded, versions_coherent, dev_char_links, persistence_mode, next_boot_module,
          boot_default, driver_updates, engine_running, runtime_registered, plain_container, gpu_container,
          cri_handler, mig_mode)


def run_checks(h: NodeHost) -> list[CheckResult]:
    return [c(h) for c in CHECKS]
