#!/usr/bin/env bash
# Makes sure the binaries the stack and the tests start are installed: redis-server (Debian package),
# PostgreSQL's initdb/pg_ctl (tests only), Debian's chromium (the admin's browser tests drive it through
# Playwright) and strace (a test slows redis-server's fsync with it). Installs them with apt when running as root; otherwise says what to install.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || missing+=(postgresql)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v strace >/dev/null 2>&1 || missing+=(strace)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing: ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "installing ${missing[*]} (apt)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
