#!/usr/bin/env bash
# Install gpuprov into /opt/gpuprov (a virtualenv, so the distro's Python stays untouched), link the commands
# into /usr/local/bin, then run `gpuprov bootstrap` with the arguments given (e.g. --yes, --dry-run: that one changes
# nothing on the host), or nothing with --install-only.
# Offline: set GPUPROV_WHEELHOUSE=DIR to install from a local wheel directory only: the newest gpuprov there replaces
# an older one (a newer one installed stays: exit 14, unless GPUPROV_ALLOW_DOWNGRADE=1). GPUPROV_PREFIX and
# GPUPROV_BIN_DIR move the virtualenv and the command's link.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=${GPUPROV_PREFIX:-/opt/gpuprov}
pip_index=() what=("$here")  # where pip takes gpuprov (and its dependencies) from
[ -z "${GPUPROV_WHEELHOUSE:-}" ] || { pip_index=(--no-index --find-links "$GPUPROV_WHEELHOUSE"); what=(gpuprov); }
# --install-only: install gpuprov and link it, and run nothing (the test hosts' set-up, an image bake).
install_only="" dry_run=""
for arg in "$@"; do [ "$arg" != --install-only ] || install_only=1; [ "$arg" != --dry-run ] || dry_run=1; done
# pip builds gpuprov's wheel in the temporary directory (TMPDIR, else /tmp), a compiler fetched for the runtime's
# front-end runs from there, and --dry-run runs gpuprov from a virtualenv there. On a /tmp mounted noexec each of
# them failed with a bare "Permission denied": find out first, and say the cause and the way out.
tmp=${TMPDIR:-/tmp}
if [ -n "$dry_run" ] || [ -z "${GPUPROV_WHEELHOUSE:-}" ]; then  # (a wheelhouse install only unpacks wheels there)
  probe=$(mktemp -d "$tmp/gpuprov-exec-check.XXXXXX")
  printf '#!/bin/sh\nexit 0\n' > "$probe/run" && chmod 700 "$probe/run"
  runs=1; "$probe/run" 2>/dev/null || runs=""
  rm -rf "$probe"
  if [ -z "$runs" ]; then
    how=$(findmnt -no OPTIONS --target "$tmp" 2>/dev/null | tr ',' '\n' | grep -x 'noexec' || true)
    echo "install.sh: programs cannot run from $tmp${how:+ (it is mounted noexec)}, where pip builds gpuprov" \
         "and the dry run's virtualenv lives; nothing was installed. Point TMPDIR at a directory on a filesystem" \
         "mounted without noexec, e.g.: TMPDIR=/var/tmp $0${*:+ $*}" >&2
    exit 4
  fi
fi
# --dry-run changes nothing on the host: no package, no $prefix, no link; gpuprov runs its plan from a throwaway
# virtualenv (its Python front-end: no compiler is fetched), removed afterwards.
for arg in "$@"; do
  [ "$arg" = --dry-run ] || continue
  echo "install.sh --dry-run: would install gpuprov into $prefix (a virtualenv; its wheel kept in $prefix/wheels)" \
       "and link ${GPUPROV_BIN_DIR:-/usr/local/bin}/gpuprov, then run: gpuprov bootstrap $*" >&2
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
    echo "install.sh --dry-run: would install python3-venv first (missing); without it no plan can be shown" >&2
    exit 0
  fi
  scratch=$(mktemp -d "$tmp/gpuprov-dry-run.XXXXXX")
  trap 'rm -rf "$scratch"' EXIT
  python3 -m venv "$scratch/venv" && "$scratch/venv/bin/pip" install -q "${pip_index[@]}" "${what[@]}"
  "$scratch/venv/bin/gpuprov" bootstrap "$@"
  exit
done
if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
  echo "installing python3-venv (needed for an isolated install)" >&2
  if command -v apt-get >/dev/null; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv;
  elif command -v dnf >/dev/null; then dnf install -y -q python3; fi
fi
[ -x "$prefix/bin/python" ] || python3 -m venv "$prefix"
# The runtime's front-end is C (a container start must not pay a Python start-up). It is compiled when gpuprov's
# wheel is built from this checkout. A fresh server has no compiler: fetch Debian's into a throwaway directory
# (apt's --download-only + dpkg -x: nothing is installed, the host's package set stays as it was) for this build
# only. Offline installs (GPUPROV_WHEELHOUSE, bundles) carry wheels built with the binary already in them.
toolchain="" path_before=$PATH
trap '[ -z "$toolchain" ] || rm -rf "$toolchain"' EXIT
if [ -z "${GPUPROV_WHEELHOUSE:-}" ] && ! command -v cc >/dev/null && ! command -v gcc >/dev/null \
   && command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
  echo "no C compiler here: fetching one into a temporary directory to build the runtime's front-end" >&2
  toolchain=$(mktemp -d "$tmp/gpuprov-toolchain.XXXXXX")
  mkdir -p "$toolchain/debs/partial" "$toolchain/root" "$toolchain/bin"
  fetch() { apt-get install -qq -y --no-install-recommends --download-only \
              -o Dir::Cache::archives="$toolchain/debs" gcc libc6-dev >/dev/null 2>&1; }
  fetch || { apt-get update -qq >/dev/null 2>&1 && fetch; } || echo "could not fetch a compiler (no package" \
    "archive?): the runtime gets the slower Python front-end; see GPUPROV_WHEELHOUSE below" >&2
  for deb in "$toolchain"/debs/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" "$toolchain/root"; done
  if [ -x "$toolchain/root/usr/bin/gcc" ]; then
    sysroot=""  # headers and libc.a from the fetched libc6-dev, unless the host had that package already
    [ -e "$toolchain/root/usr/include/stdio.h" ] && sysroot="--sysroot=$toolchain/root"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s %s "$@"\n' "$toolchain/root/usr/lib/x86_64-linux-gnu" \
      "$toolchain/root/usr/bin/gcc" "$sysroot" > "$toolchain/bin/cc"
    chmod +x "$toolchain/bin/cc"
    export PATH="$toolchain/bin:$toolchain/root/usr/bin:$PATH"
  fi
fi
if [ -n "${GPUPROV_WHEELHOUSE:-}" ]; then
  # The newest gpuprov the wheelhouse holds replaces the installed one (pip alone keeps what is there); an older one
  # only with GPUPROV_ALLOW_DOWNGRADE=1. Versions compare as pip compares them (its own packaging module).
  read -r have want < <("$prefix/bin/python" -I - "$GPUPROV_WHEELHOUSE" <<'PY'
import importlib.metadata as md, pathlib, sys
from pip._vendor.packaging.utils import parse_wheel_filename
found = []
for w in pathlib.Path(sys.argv[1]).glob("*.whl"):
    try:
        name, version, _, _ = parse_wheel_filename(w.name)
    except ValueError:
        continue
    if name == "gpuprov":
        found.append(version)
try:
    have = md.version("gpuprov")
except md.PackageNotFoundError:
    have = "-"
print(have, max(found) if found else "-")
PY
  ) || { echo "install.sh: cannot read the wheelhouse $GPUPROV_WHEELHOUSE" >&2; exit 2; }
  if [ "$want" = "-" ]; then
    echo "install.sh: no gpuprov wheel in $GPUPROV_WHEELHOUSE (build one with: pip wheel $here -w DIR)" >&2; exit 2
  fi
  if [ "$have" != "-" ] && "$prefix/bin/python" -I -c 'import sys; from pip._vendor.packaging.version import Version as V
sys.exit(not V(sys.argv[1]) > V(sys.argv[2]))' "$have" "$want" && [ "${GPUPROV_ALLOW_DOWNGRADE:-}" != 1 ]; then
    echo "install.sh: refusing to downgrade gpuprov $have to $want, the newest in $GPUPROV_WHEELHOUSE; put $have or" \
         "newer there, or set GPUPROV_ALLOW_DOWNGRADE=1 to install $want" >&2
    exit 14
  fi
  "$prefix/bin/pip" install -q --no-index --find-links "$GPUPROV_WHEELHOUSE" "gpuprov==$want"
  keep_wheel() { "$prefix/bin/pip" download -q --no-deps -d "$prefix/wheels" "${pip_index[@]}" "gpuprov==$want"; }
  if [ "$have" = "-" ]; then echo "installed gpuprov $want from $GPUPROV_WHEELHOUSE" >&2
  elif [ "$have" = "$want" ]; then echo "gpuprov $want is installed already (the newest in $GPUPROV_WHEELHOUSE)" >&2
  else echo "gpuprov $want replaced gpuprov $have (from $GPUPROV_WHEELHOUSE)" >&2; fi
else
  keep_wheel() { :; }  # built there, below
  rm -rf "$prefix/wheels.new"
  "$prefix/bin/pip" wheel -q --no-deps "$here" -w "$prefix/wheels.new"
  "$prefix/bin/pip" install -q "$prefix"/wheels.new/gpuprov-*.whl
fi
# The wheel gpuprov was installed from is kept in $prefix/wheels: `gpuprov bundle create` packs it into bundles (an
# installed gpuprov has no checkout to build one from).
mkdir -p "$prefix/wheels" && rm -f "$prefix"/wheels/gpuprov-*.whl
keep_wheel
if [ -d "$prefix/wheels.new" ]; then mv "$prefix"/wheels.new/gpuprov-*.whl "$prefix/wheels/" && rm -rf "$prefix/wheels.new"; fi
if [ -n "$toolchain" ]; then rm -rf "$toolchain"; toolchain=""; PATH=$path_before; fi
# gpuprov-runtime itself is installed by `gpuprov runtime install`: the compiled front-end the wheel carries (built
# when the wheel was built, on a machine with a C compiler), else compiled here, else a Python fallback. Say so now
# when this install can only get the fallback, with the way out.
if ! "$prefix/bin/python" -I -c 'import sys, provision.inject.install as i; sys.exit(not i.SHIPPED.exists())' 2>/dev/null \
   && ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
  echo "note: no C compiler here and the gpuprov wheel carries no compiled runtime front-end: containers will start" \
       "through the slower Python front-end. For the compiled one, build the wheels on any Linux machine of this" \
       "architecture with a C compiler (pip wheel $here -w DIR) and run GPUPROV_WHEELHOUSE=DIR $0 $*" >&2
fi
bindir=${GPUPROV_BIN_DIR:-/usr/local/bin}
ln -sf "$prefix/bin/gpuprov" "$bindir/gpuprov"
[ -z "$install_only" ] || exit 0
exec "$bindir/gpuprov" bootstrap "$@"
