#!/bin/bash
# Install from this gpuprov bundle with no network: check every file, install Python and gpuprov from the
# bundle alone, then `gpuprov bundle install` (which never falls back to the network). Arguments are passed on.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here"
sha256sum --quiet -c SHA256SUMS || { echo "Error: bundle files do not match SHA256SUMS; refusing" >&2; exit 8; }
state=/var/lib/gpuprov/bundle-apt
mkdir -p "$state/lists/partial"
echo "deb [trusted=yes] file:$here/repo ./" > "$state/bundle.list"
apt_opts=(-o "Dir::Etc::SourceList=$state/bundle.list" -o "Dir::Etc::SourceParts=-" -o "Dir::State::Lists=$state/lists"
          -o Acquire::Languages=none)
if ! [ -x /opt/gpuprov/bin/gpuprov ]; then
  if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    apt-get "${apt_opts[@]}" update -qq
    DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends python3 python3-venv
  fi
  python3 -m venv /opt/gpuprov
  /opt/gpuprov/bin/pip install -q --no-index --find-links "$here/wheels" gpuprov
  ln -sf /opt/gpuprov/bin/gpuprov /usr/local/bin/gpuprov
fi
# GPUPROV_ONLY_INSTALL=1: stop here (the Ansible role runs the rest through its module)
[ -n "${GPUPROV_ONLY_INSTALL:-}" ] && exit 0
exec /usr/local/bin/gpuprov bundle install "$here" "$@"
