#!/usr/bin/env bash
# Installs the system packages Tessera's build and tests need, when they are missing.
# Debian/Ubuntu (apt) only; elsewhere it names what to install and goes on.
set -euo pipefail

# Package : a command or file that shows it is installed.
PACKAGES=(
  "gcc:gcc"
  "libc6-dev:/usr/include/stdio.h"
  "pkg-config:pkg-config"
)

missing=()
for entry in "${PACKAGES[@]}"; do
  pkg=${entry%%:*}
  probe=${entry#*:}
  if [[ $probe == /* ]]; then [[ -e $probe ]] && continue; else command -v "$probe" >/dev/null 2>&1 && continue; fi
  missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "deps: please install: ${missing[*]}" >&2
  exit 0
fi
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo"
echo "deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
