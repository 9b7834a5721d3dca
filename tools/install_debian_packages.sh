#!/usr/bin/env bash
# Install the Debian packages named as arguments unless they are installed already: as root with
# apt-get, otherwise print the exact command that does it and go on (the MNIST demo then tries the
# cache and a download; tests that need the data are skipped).
set -euo pipefail

if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "note: no dpkg here; the Debian packages $* are used where installed (the demo downloads Fashion-MNIST instead)" >&2
    exit 0
fi
missing=()
for package in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$package")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q "${missing[@]}"
else
    echo "note: the Debian packages ${missing[*]} are not installed; install them with:" >&2
    echo "    sudo apt-get install ${missing[*]}" >&2
fi
