"""Which kernels are installed, which one the next boot starts, and whether that kernel has an NVIDIA module, read
through the host root.

The next boot: GRUB's default when /boot/grub/grub.cfg exists (its `set default`, through grubenv's `next_entry` /
`saved_entry` when the config defers to them, resolved over the menu entries and submenus as GRUB does: an index, an
entry id or an entry title, `>`-separated into submenus); else the kernel /vmlinuz (Debian) or /boot/vmlinuz (Ubuntu)
points at, which the distribution's kernel hooks keep on the newest; else the newest installed kernel.

A module counts when the kernel's modules.dep (what modprobe reads at boot) lists an nvidia kernel module whose file
is there: a DKMS build, Ubuntu's precompiled package and the .run installer all end up there. Without modules.dep the
places those three install to are looked at instead.
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import NamedTuple

from provision.facts.rootfs import read_text, under
from provision.versions import release_key

GRUB_CFG = "/boot/grub/grub.cfg"
GRUBENV = "/boot/grub/grubenv"
GRUB_DEFAULTS = "/etc/default/grub"  # the operator's settings for grub-mkconfig (never edited by gpuprov)
GRUB_DEFAULTS_D = "/etc/default/grub.d"  # grub-mkconfig sources *.cfg here after GRUB_DEFAULTS, in name order
# gpuprov's drop-in that keeps the default boot entry on a kernel with an NVIDIA module (plan/boot_default.py)
BOOT_PIN = "/etc/default/grub.d/gpuprov-boot.cfg"
BOOT_PIN_HEADER = "# Written by gpuprov"
PIN_LINE_RE = re.compile(r"^# gpuprov-boot-pin: kernel=(\S+) unserved=(\S+)$", re.M)
UPDATE_GRUB = "/usr/sbin/update-grub"
GRUB_SET_DEFAULT = "/usr/sbin/grub-set-default"
# The main module of every packaging, by its file's stem: nvidia (NVIDIA's .run installer, Ubuntu's and ELRepo's
# packages), nvidia-current[-open], nvidia-tesla-470, nvidia-legacy-390xx (Debian). Not its helpers (-uvm, -drm …)
# and not the kernel's own modules that share the prefix (nvidiafb, nvidia-wmi-ec-backlight: every Debian kernel
# has them, so a prefix match saw a module on a kernel that had none).
MAIN_MODULE_RE = re.compile(r"^nvidia(?:-current|-tesla-\d+|-legacy-\d+xx)?(?:-open)?$")
DEP_NVIDIA = re.compile(r"^([^:\n]*/nvidia[^/:\n]*\.ko[^/:\n]*):", re.M)  # a modules.dep line's nvidia* module
MODULE_DIRS = ("updates", "extra", "kernel/drivers/video", "kernel")  # without modules.dep: where modules land


class NextBoot(NamedTuple):
    kernel: str | None  # its release (uname -r form); None when no kernel is installed
    source: str  # how it was found: "GRUB's default (…)", "/vmlinuz", "the newest installed kernel"
    module: str | None  # the NVIDIA module file for it (host path), None when there is none
    module_kernels: tuple[str, ...] = ()  # the installed kernels that have an NVIDIA module


def installed_kernels(root: Path) -> list[str]:
    """Kernels with an image in /boot and a modules directory (installed by the package manager), oldest first."""
    rels = [p.name.removeprefix("vmlinuz-") for p in under(root, "/boot").glob("vmlinuz-*")]
    return sorted((r for r in rels if under(root, f"/lib/modules/{r}").is_dir()), key=release_key)


# ---------------------------------------------------------------- GRUB


class MenuEntry(NamedTuple):
    title: str
    id: str | None
    kernel: str | None  # the release its `linux` line boots (None for a submenu or a non-Linux entry)
    children: tuple[MenuEntry, ...] = ()
    submenu: bool = False


def _entry_head(line: str) -> tuple[str, str | None] | None:
    """(title, id) of a `menuentry '…' … $menuentry_id_option '…' {` or `submenu …` line."""
    try:
        words = shlex.split(line.rstrip("{").strip(), posix=True)
    except ValueError:
        return None
    if len(words) < 2:
        return None
    ident = None
    for i, w in enumerate(words):
        if w in ("$menuentry_id_option", "--id") and i + 1 < len(words):
            ident = words[i + 1]
    return words[1], ident


def parse_grub_menu(text: str) -> tuple[MenuEntry, ...]:
    """The top-level menu entries and submenus of a grub.cfg, with the kernel each entry's `linux` line boots."""
    stack: list[list] = [["", None, None, [], True]]  # title, id, kernel, children, submenu
    for raw in text.splitlines():
        line = raw.strip()
        word = line.split(None, 1)[0] if line else ""  # grub-mkconfig indents and separates with tabs too
        if word in ("menuentry", "submenu") and line.endswith("{"):
            head = _entry_head(line)
            if head:
                stack.append([head[0], head[1], None, [], word == "submenu"])
                continue
        if word in ("linux", "linuxefi", "linux16") and len(stack) > 1:
            parts = line.split()
            if len(parts) > 1:
                name = parts[1].rsplit("/", 1)[-1]
                if name.startswith("vmlinuz-"):
                    stack[-1][2] = name.removeprefix("vmlinuz-")
        elif line == "}" and len(stack) > 1:
            title, ident, kernel, children, sub = stack.pop()
            stack[-1][3].append(MenuEntry(title, ident, kernel, tuple(children), sub))
    return tuple(stack[0][3])


def _grubenv(root: Path) -> dict[str, str]:
    text = read_text(root, GRUBENV) or ""
    return dict(ln.split("=", 1) for ln in text.splitlines() if "=" in ln and not ln.startswith("#"))


def grub_default(text: str, env: dict[str, str]) -> tuple[str, str]:
    """(the entry GRUB boots next, where that came from): grubenv's next_entry when the config honours it, else the
    unconditional `set default`, through saved_entry when it names it."""
    defaults = re.findall(r'^\s*set\s+default\s*=\s*"?([^"\n]*)"?\s*$', text, re.M)
    if any("next_entry" in d for d in defaults) and env.get("next_entry"):
        return env["next_entry"], "GRUB's next_entry (grubenv)"
    plain = [d for d in defaults if "next_entry" not in d]
    value = plain[-1] if plain else "0"
    if "saved_entry" in value:
        return env.get("saved_entry") or "0", "GRUB's saved_entry (grubenv)"
    return value, "GRUB's default (grub.cfg)"


def resolve_entry(menu: tuple[MenuEntry, ...], path: str) -> MenuEntry | None:
    """GRUB's reading of a default: `>`-separated parts, each an index, an entry id or an entry title."""
    entries, found = menu, None
    for part in path.split(">"):
        part = part.strip()
        if part.isdigit():
            found = entries[int(part)] if int(part) < len(entries) else None
        else:
            found = next((e for e in entries if part in (e.id, e.title)), None)
        if found is None:
            return None
        entries = found.children
    if found is not None and found.submenu:  # a submenu as the default boots its first entry
        return found.children[0] if found.children else None
    return found


def grub_next_kernel(root: Path) -> tuple[str | None, str]:
    text = read_text(root, GRUB_CFG)
    if not text:
        return None, ""
    default, source = grub_default(text, _grubenv(root))
    entry = resolve_entry(parse_grub_menu(text), default)
    return (entry.kernel if entry else None), f"{source}: {default!r}"


def grub_setting(text: str, key: str) -> str | None:
    """The last `KEY=value` of a shell-style settings file (/etc/default/grub), quotes taken off; None: not set."""
    value = None
    for line in text.splitlines():
        m = re.match(rf"^\s*(?:export\s+)?{key}=(.*)$", line)
        if m:
            try:
                words = shlex.split(m.group(1), comments=True)
            except ValueError:
                continue
            value = words[0] if words else ""
    return value


class GrubSetup(NamedTuple):
    """What deciding the default boot entry needs of GRUB (read only where grub.cfg and update-grub are there)."""
    menu: tuple[MenuEntry, ...]  # grub.cfg's menu, as grub-mkconfig wrote it
    saved: bool  # the operator's settings say GRUB_DEFAULT=saved: grub-set-default chooses the default
    saved_entry: str | None  # grubenv's saved_entry
    later: str | None  # an operator's file of /etc/default/grub.d read after gpuprov's drop-in that sets GRUB_DEFAULT
    set_default: bool  # grub-set-default is there


def read_grub(root: Path) -> GrubSetup | None:
    """GRUB as grub-mkconfig configures it on Debian and Ubuntu; None where there is no /boot/grub/grub.cfg or no
    update-grub (another boot loader, or none: gpuprov never touches it)."""
    text = read_text(root, GRUB_CFG)
    if not text or not under(root, UPDATE_GRUB).exists():
        return None
    drop_ins = sorted(p for p in under(root, GRUB_DEFAULTS_D).glob("*.cfg") if p.name != Path(BOOT_PIN).name)
    default = grub_setting(read_text(root, GRUB_DEFAULTS) or "", "GRUB_DEFAULT")
    later = None
    for p in drop_ins:  # grub-mkconfig reads them in this order, each over the one before
        value = grub_setting(read_text(root, f"{GRUB_DEFAULTS_D}/{p.name}") or "", "GRUB_DEFAULT")
        if value is not None:
            default = value
            later = f"{GRUB_DEFAULTS_D}/{p.name}" if p.name > Path(BOOT_PIN).name else later
    return GrubSetup(parse_grub_menu(text), default == "saved", _grubenv(root).get("saved_entry"), later,
                     under(root, GRUB_SET_DEFAULT).exists())


def entry_path(menu: tuple[MenuEntry, ...], kernel: str) -> str | None:
    """The menu entry that boots `kernel` normally, as GRUB_DEFAULT and grub-set-default name it: the advanced
    submenu's entry by ids ("gnulinux-advanced-<uuid>>gnulinux-<kernel>-advanced-<uuid>", as grub-mkconfig's
    10_linux names them; titles where it wrote no ids), else a top-level entry of that kernel. Recovery entries are
    never chosen."""
    def normal(e: MenuEntry) -> bool:
        return e.kernel == kernel and "recovery" not in (e.id or "") and "recovery mode" not in e.title
    for sub in (e for e in menu if e.submenu):
        child = next((c for c in sub.children if normal(c)), None)
        if child:
            return f"{sub.id or sub.title}>{child.id or child.title}"
    top = next((e for e in menu if not e.submenu and normal(e)), None)
    return (top.id or top.title) if top else None


class PinFile(NamedTuple):
    kernel: str  # the kernel the default boot entry stays on
    unserved: str  # the kernel without a module that would have booted next


def read_pin_text(text: str | None) -> PinFile | None:
    """gpuprov's drop-in, by its header and its pin line (None: not there, or not gpuprov's)."""
    m = PIN_LINE_RE.search(text or "")
    return PinFile(m.group(1), m.group(2)) if m and (text or "").startswith(BOOT_PIN_HEADER) else None


def read_pin(root: Path) -> PinFile | None:
    return read_pin_text(read_text(root, BOOT_PIN))


# ---------------------------------------------------------------- the kernel that boots next, and its module


def _link_kernel(root: Path) -> tuple[str | None, str]:
    for link in ("/vmlinuz", "/boot/vmlinuz"):
        try:
            target = os.readlink(under(root, link))
        except OSError:
            continue
        return Path(target).name.removeprefix("vmlinuz-"), link
    return None, ""


def next_boot_kernel(root: Path) -> tuple[str | None, str]:
    """(the kernel the next boot starts, how that was found)."""
    kernel, source = grub_next_kernel(root)
    if kernel:
        return kernel, source
    kernel, link = _link_kernel(root)
    if kernel:
        return kernel, link
    kernels = installed_kernels(root)
    return (kernels[-1], "the newest installed kernel") if kernels else (None, "no installed kernel")


def unpinned_next_kernel(root: Path, pinned: bool) -> str | None:
    """The kernel the next boot would start without gpuprov's pin of the default entry (`pinned`): the kernel the
    distribution's hooks point /vmlinuz (/boot/vmlinuz) at, the newest, as grub-mkconfig's first entry; else GRUB's
    default as it is."""
    if pinned:
        kernel, _ = _link_kernel(root)
        if kernel and under(root, f"/lib/modules/{kernel}").is_dir():
            return kernel
        kernels = installed_kernels(root)
        return kernels[-1] if kernels else None
    return next_boot_kernel(root)[0]


def _is_main_module(name: str) -> bool:
    return ".ko" in name and MAIN_MODULE_RE.match(name.split(".ko", 1)[0]) is not None


def nvidia_module(root: Path, kernel: str) -> str | None:
    """The NVIDIA kernel module installed for `kernel` (host path), or None."""
    base = f"/lib/modules/{kernel}"
    dep = read_text(root, f"{base}/modules.dep")
    if dep is not None:
        for m in DEP_NVIDIA.finditer(dep):  # a regex over the text: modules.dep has thousands of lines
            rel = m.group(1)
            if _is_main_module(rel.rsplit("/", 1)[-1]):
                path = rel if rel.startswith("/") else f"{base}/{rel}"
                if under(root, path).is_file():
                    return path
        return None
    for d in MODULE_DIRS:
        top = under(root, f"{base}/{d}")
        found = sorted(top.rglob("nvidia*.ko*")) if d != "kernel" else sorted(top.glob("nvidia*/nvidia*.ko*"))
        for p in found:
            if _is_main_module(p.name):
                return "/" + str(p.relative_to(root))
    return None


def read_next_boot(root: Path) -> NextBoot:
    kernel, source = next_boot_kernel(root)
    with_module = tuple(k for k in installed_kernels(root) if nvidia_module(root, k))
    return NextBoot(kernel, source, nvidia_module(root, kernel) if kernel else None, with_module)
