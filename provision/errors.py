"""One domain exception, caught in one place (cli.main), with stable exit codes.

Exit codes (documented in README.md):
  0  ok
  1  internal error (a bug: please report)
  2  usage error (bad option or argument, e.g. a malformed PCI id)
  3  host unreadable (os-release missing or unreadable, --root not a host tree)
  4  unsupported host or target (distro/release gpuprov has no rules for)
  5  a step failed (command or package install failed; nothing after it ran)
  6  refused to edit a config that is not valid (file left byte-for-byte untouched), or to write through a link
     or into a directory another user could have planted or can write (--allow-shared-dir), or to trust state
     another user can write
  7  reboot required to finish (state recorded; run bootstrap again after the reboot)
  8  bundle verification failed (checksum, signature, manifest)
  9  bundle does not match this host (distro release, kernel, arch)
 10  GPU requirement not satisfied (NVIDIA_REQUIRE_*) / verification failed
 11  host busy: another gpuprov run holds the host lock and --no-wait was given
 12  declined at the confirmation prompt (nothing was changed)
 13  disk full or read-only: a write could not complete; the file is untouched
 14  conflicts with the operator's own setting (a runtime of that name pointing elsewhere, another
     default-runtime; --replace-runtime overrides), a package install that would remove installed packages
     (named; --allow-remove overrides), a file that kept changing while gpuprov edited it, or an engine purge
     that would delete the operator's containers, images or volumes (named; --keep-engine-data or
     --delete-engine-data says which)
 15  driver installed, but no NVIDIA device to verify it on (image baking, a VM without its GPU)
 16  the driver's kernel module failed to build (DKMS), named with the compiler's first error: on apt the module
     package rolled back (dpkg consistent), on dnf/yum the packages kept (nothing half-installed)
130  interrupted (Ctrl-C; as a shell reports SIGINT): re-run, every step is idempotent
"""
from __future__ import annotations

OK = 0
INTERNAL = 1
USAGE = 2
HOST_UNREADABLE = 3
UNSUPPORTED = 4
STEP_FAILED = 5
CONFIG_INVALID = 6
REBOOT_REQUIRED = 7
BUNDLE_INVALID = 8
BUNDLE_MISMATCH = 9
REQUIREMENT_FAILED = 10
HOST_BUSY = 11
DECLINED = 12
WRITE_FAILED = 13
CONFLICT = 14
NO_DEVICE = 15
DKMS_FAILED = 16
INTERRUPTED = 130


class Refused(Exception):
    """The runtime refuses a container (it asked for something this host cannot give): one line, through runc's
    log to the user; the runtime exits REQUIREMENT_FAILED. Not a GpuprovError: it never reaches cli.main."""

    exit_code = REQUIREMENT_FAILED


class EditFailed(Exception):
    """The runtime could not prepare a GPU container's edits (an unreadable bundle, a config.json of types runc would
    reject): the start is refused in one line, exit INTERNAL. Like Refused, only the runtime raises it."""

    exit_code = INTERNAL


class GpuprovError(Exception):
    """A user-facing failure: one line saying what is wrong and what to do."""

    exit_code = INTERNAL

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(GpuprovError):
    exit_code = USAGE


class HostUnreadable(GpuprovError):
    exit_code = HOST_UNREADABLE


class Unsupported(GpuprovError):
    exit_code = UNSUPPORTED


class StepFailed(GpuprovError):
    exit_code = STEP_FAILED


class BundleInvalid(GpuprovError):
    """An offline bundle failed verification (checksums, signature, manifest, members)."""
    exit_code = BUNDLE_INVALID
    problems: list[str]  # every problem found, when verification found several


class BundleMismatch(GpuprovError):
    """An offline bundle is for another release, architecture or kernel than this host."""
    exit_code = BUNDLE_MISMATCH


class ConfigInvalid(GpuprovError):
    exit_code = CONFIG_INVALID


class RebootRequired(GpuprovError):
    exit_code = REBOOT_REQUIRED


class HostBusy(GpuprovError):
    exit_code = HOST_BUSY


class Declined(GpuprovError):
    exit_code = DECLINED


class WriteFailed(GpuprovError, OSError):
    """Disk full, quota, read-only filesystem: the write did not happen and the old file is intact. Also an OSError,
    so code that already handles failed writes (the runtime editor refusing a start) keeps handling it."""

    exit_code = WRITE_FAILED


class RuntimeConflict(GpuprovError):
    """The operator's own runtime / default-runtime would be replaced: theirs unless --replace-runtime."""

    exit_code = CONFLICT


class RemovalRefused(GpuprovError):
    """A package install would remove installed packages (apt's simulation says `Remv`, dnf/yum's transaction says
    Removing/replacing): refused before anything changed, unless --allow-remove."""

    exit_code = CONFLICT


class RestartRefused(GpuprovError):
    """A change needs the engine restarted, and that would stop its running containers (dockerd without
    live-restore): refused before anything changed, unless --restart-engine."""

    exit_code = CONFLICT


class EngineDataAtStake(GpuprovError):
    """`uninstall --purge-engine`: a package's purge would delete an engine's data root holding containers, images
    or volumes of the operator's (Debian's docker.io: /var/lib/docker), and neither --keep-engine-data nor
    --delete-engine-data was given: refused before anything changed, naming them."""

    exit_code = CONFLICT


class NoDeviceToVerify(GpuprovError):
    """The driver is installed and its module built, but there is no NVIDIA device here to load it on."""

    exit_code = NO_DEVICE


class DkmsBuildFailed(GpuprovError):
    """DKMS could not build the kernel module: named with the compiler's first error; rolled back."""

    exit_code = DKMS_FAILED


class UntrustedPath(ConfigInvalid, OSError):
    """A path root would write through, or read state from, that another user could have planted or can change: a
    link not root's or in a directory others can write, a shared directory without the sticky bit, a state file
    others can write (provision/fsutil.py). Also an OSError, so best-effort writers (caches) treat it as a miss."""


class ConcurrentEdit(GpuprovError):
    """The file changed between gpuprov's read and its rename (an operator saved it meanwhile) and kept changing
    over every retry: refused, with the operator's file as they saved it."""

    exit_code = CONFLICT
