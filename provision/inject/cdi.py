"""CDI specs (REFERENCE.md §5) from discovery, and applying one to an OCI config (what a CDI-aware engine does).

Same devices and files as `nvidia-ctk cdi generate` on the same host (every capability: utility, compute, video,
graphics, display, ngx), with gpuprov's no-hook design: libraries are mounted at their SONAME in the directories
images' loaders search by default, so no create-symlinks or update-ldcache hook has to run in the container.
`refresh_specs` is the one way specs reach /var/run/cdi and /etc/cdi (CLI `gpuprov cdi refresh`, the systemd path
unit, Kubernetes node set-up)."""
from __future__ import annotations

import json
import os
import sys

from provision.errors import ConfigInvalid, Unsupported
from provision.facts.rootfs import MAX_READ, NotRegular, is_live, read_bytes_bounded
from provision.fsutil import write_file
from provision.inject import discover, edits, nodes
from provision.inject.capabilities import CAPABILITIES
from provision.inject.discover import Discovery, Gpu

KIND = "nvidia.com/gpu"
LIBDIRS = (edits.DEBIAN_LIBDIR, edits.RHEL_LIBDIR)
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")  # what docker, containerd, CRI-O and podman read by default
SPEC_NAME = "nvidia.yaml"
MARKER = "GPUPROV_DRIVER_VERSION"  # in every spec gpuprov writes: a file without it is someone else's
UVM_PATHS = ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def _gpu_edits(g: Gpu) -> dict:
    return {"deviceNodes": [edits.device_node(n).cdi() for n in (g.node, *g.drm)]}


def generate_spec(disc: Discovery, *, libdirs: tuple[str, ...] = LIBDIRS) -> dict:
    """One spec: devices by index, by UUID and `all`; common edits (control nodes, every capability's files)."""
    caps = [c for c in CAPABILITIES if c != "compat32"] + (["compat32"] if disc.libraries32 else [])
    mounts, seen = [], set()
    for m in edits.driver_mounts(disc, caps, libdir=libdirs[0], with_firmware=True):
        dests = [m.destination]
        if m.destination.startswith(libdirs[0] + "/"):  # the image's loader picks one of these by distro
            dests = [d + m.destination[len(libdirs[0]):] for d in libdirs]
        for d in dests:
            if d not in seen:
                seen.add(d)
                mounts.append(m.cdi(d))
    ipc = edits.persistenced_mount(disc)
    if ipc is not None:
        mounts.append(ipc.cdi())
    gpu_devices = []
    for g in disc.gpus:
        gpu_devices.append({"name": str(g.index), "containerEdits": _gpu_edits(g)})
        if g.uuid:
            gpu_devices.append({"name": g.uuid, "containerEdits": _gpu_edits(g)})
    all_nodes = [n for g in disc.gpus for n in _gpu_edits(g)["deviceNodes"]]
    for d in disc.mig.devices if disc.mig is not None else ():  # each MIG device under each of its names (mig.py)
        parent = next((g for g in disc.gpus if g.index == d.gpu), None)
        if parent is None:
            continue
        caps = [edits.device_node(n).cdi() for n in disc.mig.nodes(d)]
        nodes = [edits.device_node(parent.node).cdi(), *caps]
        gpu_devices += [{"name": name, "containerEdits": {"deviceNodes": nodes}} for name in d.names()]
        all_nodes += [n for n in caps if n not in all_nodes]  # `all`: every GPU and every instance
    control = [edits.device_node(n).cdi() for n in disc.nodes.present()]
    if disc.gpus and disc.nodes.uvm is None:  # every NVIDIA GPU computes: CUDA needs these, and a spec without them
        # starts containers where nvidia-smi works and CUDA fails. Listed by path only (no major: nvidia-uvm is not
        # loaded now), so the engine resolves them when a container starts and refuses it while they are missing.
        control += [{"path": p, "hostPath": p, "permissions": "rw"} for p in UVM_PATHS]
    return {
        # 0.5.0: the lowest version allowing device names that start with a digit and hostPath on device nodes.
        "cdiVersion": "0.5.0",
        "kind": KIND,
        "devices": gpu_devices + [{"name": "all", "containerEdits": {"deviceNodes": all_nodes}}],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void", f"{MARKER}={disc.version}"],
            "deviceNodes": control,
            "mounts": mounts,
        },
    }


def render(spec: dict, fmt: str = "yaml") -> str:
    if fmt == "json":
        return json.dumps(spec, indent=2) + "\n"
    import yaml  # lazy: 11 ms at start-up (-X importtime, min of 15); plans import this module, only writing a spec needs it

    return yaml.safe_dump(spec, sort_keys=False)


def refresh_specs(driver_root: str = "/", *, dirs: tuple[str, ...] = SPEC_DIRS, proc_root: str = "/",
                  dev_root: str = "/", gen_dir: str | None = None) -> list[str]:
    """(Re)write DIR/nvidia.yaml in each of `dirs` from the running driver; returns the files that changed (none
    when the driver did not change). Refuses to replace a spec that gpuprov did not write (e.g. nvidia-ctk's).
    Kubernetes node set-up calls this; so does `gpuprov cdi refresh` and the gpuprov-cdi-refresh systemd units.
    First nvidia-uvm is loaded and missing nodes made (nodes.prepare_host), so that the spec names them with their
    numbers."""
    for line in nodes.prepare_host(proc_root, dev_root):  # at boot these reach the unit's journal
        print(line, file=sys.stderr)
    disc = discover.discover(driver_root, proc_root=proc_root, dev_root=dev_root)
    if not disc.version:
        raise Unsupported("no NVIDIA driver is loaded (/proc/driver/nvidia/version): no CDI spec to write; "
                          "install one with `gpuprov bootstrap`")
    # Every spec there now is read (bounded, non-blocking) and judged before anything is written, manifests included:
    # a FIFO, a directory or a foreign spec in either place refuses the whole refresh, with nothing touched.
    olds = {os.path.join(d, SPEC_NAME): _current_spec(os.path.join(d, SPEC_NAME)) for d in dirs}
    text = render(generate_spec(discover.write_manifests(disc, gen_dir or discover.GENERATED_DIR)))
    changed = []
    for d in dirs:
        path = os.path.join(d, SPEC_NAME)
        if olds[path] == text:
            continue
        write_file(path, text, mode=0o644, keep_mode=False, backup=False)  # `d` made 0755 if need be
        changed.append(path)
    return changed


def _current_spec(path: str) -> str | None:
    """The spec at `path` (None: there is none), refused (ConfigInvalid, exit 6) when it is not a regular file (a FIFO
    would block the read forever, under the host lock and before the engine at boot), too large, or not gpuprov's."""
    try:
        old = read_bytes_bounded(path, MAX_READ + 1).decode(errors="replace")
    except FileNotFoundError:
        return None
    except NotRegular:
        raise ConfigInvalid(f"{path} is not a regular file (a FIFO, directory or device); move it aside, then run "
                            "`gpuprov cdi refresh` again (nothing was changed)") from None
    except OSError as exc:
        raise ConfigInvalid(f"cannot read {path}: {exc.strerror}; nothing was changed") from None
    if len(old) > MAX_READ or MARKER not in old:
        raise ConfigInvalid(f"{path} was not written by gpuprov (NVIDIA's nvidia-ctk?); remove it or keep using it "
                            "(nothing was changed)")
    return old


def refresh_units(gpuprov: str, engine_unit: str | None = None) -> dict[str, str]:
    """systemd units that keep the spec current (file name -> text); the one definition, also used by
    `gpuprov k8s node`. The service runs at every boot before the engine (/var/run/cdi is a tmpfs and a new driver
    becomes the loaded one at boot); the path unit re-runs it when a driver install runs depmod for the running
    kernel (modules.dep.bin changes). procfs cannot be watched with inotify, so /proc/driver/nvidia is not."""
    before = f"Before={engine_unit}\n" if engine_unit else ""
    return {
        "gpuprov-cdi-refresh.service": f"""[Unit]
Description=Refresh gpuprov's CDI spec for the NVIDIA driver loaded now (/etc/cdi, /var/run/cdi)
After=systemd-modules-load.service nvidia-persistenced.service
{before}ConditionPathExists=/proc/driver/nvidia/version

[Service]
Type=oneshot
ExecStart={gpuprov} cdi refresh

[Install]
WantedBy=multi-user.target
""",
        "gpuprov-cdi-refresh.path": """[Unit]
Description=Refresh gpuprov's CDI spec when NVIDIA kernel modules are installed for the running kernel

[Path]
PathChanged=/lib/modules/%v/modules.dep.bin
Unit=gpuprov-cdi-refresh.service

[Install]
WantedBy=paths.target
""",
    }


class SpecCurrent:
    """Bootstrap's check for its `cdi.spec` step: the spec files hold what `gpuprov cdi refresh` would write now and
    the refresh units are installed (where systemd runs)."""

    def __init__(self, driver_root: str, dirs: tuple[str, ...] = SPEC_DIRS, unit_dir: str = "/etc/systemd/system"):
        self.driver_root, self.dirs, self.unit_dir = driver_root, dirs, unit_dir

    def satisfied(self, root) -> bool:
        if not is_live(root):
            return False
        disc = discover.discover(self.driver_root)
        if not disc.version:
            return False
        text = render(generate_spec(discover.write_manifests(disc)))
        for d in self.dirs:
            try:
                with open(os.path.join(d, SPEC_NAME)) as fh:
                    if fh.read() != text:
                        return False
            except OSError:
                return False
        units = not os.path.isdir("/run/systemd/system") or all(
            os.path.exists(os.path.join(self.unit_dir, n)) for n in refresh_units("gpuprov"))
        return units

    def describe(self) -> str:
        return f"skipped when {', '.join(os.path.join(d, SPEC_NAME) for d in self.dirs)} match the loaded driver"
