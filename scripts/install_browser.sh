#!/usr/bin/env bash
# Install Debian's `chromium` for the browser test (tests/server/test_page_browser.py).
#
# Non-interactive and idempotent: does nothing when a chromium binary is
# already on PATH. The test drives the browser over the DevTools protocol,
# so no webdriver, selenium or playwright download is needed (and none
# could be made: only Debian's package registry is reachable from CI).
#
# Usage: bash scripts/install_browser.sh     (as root, or with sudo on PATH)
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    echo "install_browser: $(command -v chromium) already installed: $(chromium --version 2>/dev/null || echo 'version unknown')"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: apt-get not found; install a 'chromium' binary on PATH by hand" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_browser: need root (or sudo) to run apt-get" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing or stale on a fresh machine; without an
# update apt-get cannot find chromium at all.
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium

if ! command -v chromium >/dev/null 2>&1; then
    echo "install_browser: apt-get finished but no 'chromium' binary is on PATH" >&2
    exit 1
fi
echo "install_browser: installed $(chromium --version 2>/dev/null || command -v chromium)"
