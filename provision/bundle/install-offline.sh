#!/bin/bash
# Install from this gpuprov bundle with no network. Nothing from the bundle runs (no package's maintainer script,
# not its gpuprov) before this script has checked it with the host's own tools:
#   - the bundle holds only directories and regular files (no link, device, FIFO, setuid/setgid file);
#   - SHA256SUMS: each line `<sha256>  <path>`, the path plain and inside the bundle, each path once, every file
#     of the bundle listed, every checksum right (sha256sum);
#   - the signature of SHA256SUMS, with the host's gpgv: required when --keyring FILE is given, when the manifest
#     names signing keys, or when a SHA256SUMS.sig is there; valid only when gpgv's status lines show a VALIDSIG and
#     no expired or revoked key, expired or bad signature (gpgv's exit status alone accepts the first two).
# All of it on a private copy of the bundle, which is what gets installed. Any failure: exit 8, nothing run or
# installed (tests/faults/test_bundle_offline.py). Arguments (e.g. --keyring FILE, --json) are passed on to
# `gpuprov bundle install`, which copies and verifies the bundle again before installing.
set -euo pipefail
export LC_ALL=C
fail() { echo "Error: $*; refusing the bundle (nothing from it was run or installed)" >&2; exit 8; }
# Why the signature is not valid ("" when it is), from gpgv's machine-readable status (--status-fd), read as
# gpuprov's manifest.status_problem reads it: a VALIDSIG, and no EXPKEYSIG/REVKEYSIG (gpgv exits 0 for those),
# EXPSIG, BADSIG, ERRSIG or NO_PUBKEY.
sig_problem() {
  local st pair rc=0
  st=$(gpgv --status-fd 1 "$@" SHA256SUMS.sig SHA256SUMS 2>/dev/null) || rc=$?
  for pair in "EXPKEYSIG:was made by an expired key" "REVKEYSIG:was made by a revoked key" "EXPSIG:has expired" \
              "BADSIG:does not verify" "ERRSIG:does not verify" "NO_PUBKEY:does not verify"; do
    if grep -q "^\[GNUPG:\] ${pair%%:*}\( \|$\)" <<<"$st"; then echo "${pair#*:}"; return 0; fi
  done
  [ "$rc" = 0 ] && grep -q '^\[GNUPG:\] VALIDSIG ' <<<"$st" || echo "does not verify"
}

keyring=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --keyring|--keyring=*)
      if [ "$1" = --keyring ]; then keyring="${2:-}"; shift; else keyring="${1#--keyring=}"; fi
      keyring=$(realpath -e -- "$keyring" 2>/dev/null) && [ -f "$keyring" ] ||
        { echo "Error: --keyring needs an existing file (gpg --export KEY > FILE)" >&2; exit 2; }
      args+=(--keyring "$keyring") ;;
    *) args+=("$1") ;;
  esac
  shift
done

src=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
# Everything below reads a private copy, in root's own new 0700 directory (removed on exit): no other user who can
# write the bundle can swap a file between these checks and the install. Links, FIFOs, devices and setuid bits are
# copied as they are (never followed or opened), so the checks below still see and refuse them.
work=$(mktemp -d "${TMPDIR:-/tmp}/gpuprov-offline-XXXXXX")
trap 'rm -rf -- "$work"' EXIT
cp -R --preserve=mode -- "$src/." "$work/bundle" || fail "cannot copy $src into $work"
here=$work/bundle
cd "$here"
for f in manifest.json SHA256SUMS; do
  [ -f "$f" ] && [ ! -L "$f" ] || fail "$src/$f is missing or not a regular file"
done
odd=$(find . \( -type l -o \( ! -type f ! -type d \) -o \( -type f -perm /6000 \) \) -print -quit)
[ -z "$odd" ] || fail "${odd#./} is a link, a special file or setuid/setgid"
bad=$(grep -nvE '^[0-9a-f]{64}  [A-Za-z0-9_.+~=:@%,-]+(/[A-Za-z0-9_.+~=:@%,-]+)*$' SHA256SUMS | head -n 1 || true)
[ -z "$bad" ] || fail "SHA256SUMS line ${bad%%:*} is not \`<sha256>  <plain relative path>\`"
names=$(cut -c67- SHA256SUMS)
bad=$(grep -nE '(^|/)\.\.?(/|$)' <<<"$names" | head -n 1 || true)
[ -z "$bad" ] || fail "SHA256SUMS names ${bad#*:}, a path leading out of the bundle"
bad=$(sort <<<"$names" | uniq -d | head -n 1)
[ -z "$bad" ] || fail "SHA256SUMS lists $bad twice"
grep -qxE 'SHA256SUMS(\.sig)?' <<<"$names" && fail "SHA256SUMS lists itself or its signature"
bad=$(comm -23 <(find . -type f ! -path ./SHA256SUMS ! -path ./SHA256SUMS.sig | sed 's|^\./||' | sort) \
               <(sort <<<"$names") | head -n 1)
[ -z "$bad" ] || fail "$bad is not listed in SHA256SUMS"

# Signed unless the manifest says, exactly, that it names no signing keys (json.dumps' own layout).
signed_manifest=true
grep -qxE '  "keys": \[\],?' manifest.json && signed_manifest=false
if [ -n "$keyring" ] || [ "$signed_manifest" = true ] || [ -e SHA256SUMS.sig ]; then
  [ -f SHA256SUMS.sig ] && [ ! -L SHA256SUMS.sig ] ||
    fail "SHA256SUMS.sig is missing but the bundle must be signed ($([ -n "$keyring" ] && echo "--keyring was given" ||
          echo "its manifest names signing keys"))"
  command -v gpgv >/dev/null || fail "gpgv is not installed: the signature cannot be checked"
  kr=()
  [ -z "$keyring" ] || kr=(--keyring "$keyring")
  why=$(sig_problem "${kr[@]}")
  [ -z "$why" ] || fail "the signature of SHA256SUMS $why$([ -n "$keyring" ] && echo " against $keyring" ||
                        echo " (pass --keyring FILE with the signer's key)")"
fi
sha256sum --quiet --strict -c SHA256SUMS || fail "bundle files do not match SHA256SUMS"

state=/var/lib/gpuprov/bundle-apt
mkdir -p "$state/lists/partial"
echo "deb [trusted=yes] file:$here/repo ./" > "$state/bundle.list"  # trusted: SHA256SUMS was verified above
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
/usr/local/bin/gpuprov bundle install "$here" "${args[@]}"  # not exec: the trap removes the copy afterwards
