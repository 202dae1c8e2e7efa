"""One domain exception, caught in one place (cli.main), with stable exit codes.

Exit codes (documented in README.md):
  0  ok
  1  internal error (a bug: please report)
  2  usage error (bad option or argument, e.g. a malformed PCI id)
  3  host unreadable (os-release missing or unreadable, --root not a host tree)
  4  unsupported host or target (distro/release gpuprov has no rules for)
  5  a step failed (command or package install failed; nothing after it ran)
  6  refused to edit a config that is not valid (file left byte-for-byte untouched)
  7  reboot required to finish (state recorded; run bootstrap again after the reboot)
  8  bundle verification failed (checksum, signature, manifest)
  9  bundle does not match this host (distro release, kernel, arch)
 10  GPU requirement not satisfied (NVIDIA_REQUIRE_*) / verification failed
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


class ConfigInvalid(GpuprovError):
    exit_code = CONFIG_INVALID


class RebootRequired(GpuprovError):
    exit_code = REBOOT_REQUIRED
