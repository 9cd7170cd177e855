#!/usr/bin/env bash
# Installs the Debian packages the tests drive for real: Prometheus and promtool (rules, unit tests, the
# end-to-end chain), kubectl (kustomize rendering), yamllint, Chromium + chromedriver (browser tests),
# docker-compose (compose file validation; no Docker engine is needed for `docker-compose config`), the
# shell script linter for the deploy scripts, and node_exporter (the reference an HTTP test compares the sidecar's
# answers with, request by request: Go's net/http behind the exporter-toolkit; started on 127.0.0.1 by the test), and
# strace (counts the system calls of the hook's per-step record: there must be none).
# Run as root on Debian. Idempotent: silent and offline when everything is present; `apt-get update` runs at
# most once, and only when something is missing.
set -euo pipefail

# command -> Debian package that provides it.
declare -A WANT=(
    [prometheus]=prometheus
    [promtool]=prometheus
    [kubectl]=kubernetes-client
    [yamllint]=yamllint
    [chromium]=chromium
    [chromedriver]=chromium-driver
    [docker-compose]=docker-compose
    [shellcheck]=shellcheck
    [prometheus-node-exporter]=prometheus-node-exporter
    [strace]=strace
)

missing=()
for cmd in "${!WANT[@]}"; do
    if ! command -v "$cmd" >/dev/null 2>&1; then
        missing+=("${WANT[$cmd]}")
    fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
# De-duplicate (prometheus provides two commands) and sort for a stable log line.
mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)

if [[ $EUID -ne 0 ]]; then
    echo "ensure-system-deps: missing ${packages[*]}; run as root (apt-get install)" >&2
    exit 1
fi

# Package maintainer scripts must not start services here: Debian's prometheus would otherwise start a
# server on :9090 on every interface (and node_exporter one on :9100). Respect an existing policy; add (and later remove) ours only if none.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    own_policy=1
fi
cleanup() { if [[ $own_policy -eq 1 ]]; then rm -f "$policy"; fi; }
trap cleanup EXIT

echo "ensure-system-deps: installing ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
# Other builders may hold the dpkg lock for a while; wait for it instead of failing.
APT=(apt-get -q -o DPkg::Lock::Timeout=600)
"${APT[@]}" update -qq
"${APT[@]}" install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
for cmd in "${!WANT[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || { echo "ensure-system-deps: $cmd still missing" >&2; exit 1; }
done
echo "ensure-system-deps: done"
