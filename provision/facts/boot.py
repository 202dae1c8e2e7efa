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
