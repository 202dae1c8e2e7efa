#!/usr/bin/env bash
# Install gpuprov into /opt/gpuprov (a virtualenv, so the distro's Python stays untouched), link the commands
# into /usr/local/bin, then run `gpuprov bootstrap` with the arguments given (e.g. --yes, --dry-run).
# Offline: set GPUPROV_WHEELHOUSE=DIR to install from a local wheel directory only.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=${GPUPROV_PREFIX:-/opt/gpuprov}
if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
  echo "installing python3-venv (needed for an isolated install)" >&2
  if command -v apt-get >/dev/null; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv;
  elif command -v dnf >/dev/null; then dnf install -y -q python3; fi
fi
[ -x "$prefix/bin/python" ] || python3 -m venv "$prefix"
if [ -n "${GPUPROV_WHEELHOUSE:-}" ]; then
  "$prefix/bin/pip" install -q --no-index --find-links "$GPUPROV_WHEELHOUSE" gpuprov
else
  "$prefix/bin/pip" install -q "$here"
fi
# gpuprov-runtime itself is installed by `gpuprov runtime install`: the compiled front-end the wheel carries (built
# when the wheel was built, on a machine with a C compiler), else compiled here, else a Python fallback. Say so now
# when this install can only get the fallback, with the way out.
if ! "$prefix/bin/python" -c 'import sys, provision.inject.install as i; sys.exit(not i.SHIPPED.exists())' 2>/dev/null \
   && ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
  echo "note: no C compiler here and the gpuprov wheel carries no compiled runtime front-end: containers will start" \
       "through the slower Python front-end. For the compiled one, build the wheels on any Linux machine of this" \
       "architecture with a C compiler (pip wheel $here -w DIR) and run GPUPROV_WHEELHOUSE=DIR $0 $*" >&2
fi
ln -sf "$prefix/bin/gpuprov" /usr/local/bin/gpuprov
exec /usr/local/bin/gpuprov bootstrap "$@"
