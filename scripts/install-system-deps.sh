#!/usr/bin/env bash
# Install the system packages the embedded stack, its tests, the hosts target's nginx example
# and the game-day report (Allure on Node, checked in headless Chromium) need, when they are
# missing; openssl makes the certificates of the Kubernetes tests' control plane.
# Safe to run again: it installs nothing when everything is there.
set -euo pipefail
declare -A package_of=([redis-server]=redis-server [haproxy]=haproxy [nginx]=nginx [iptables]=iptables [ip]=iproute2 [prometheus]=prometheus [chromium]=chromium [node]=nodejs [npm]=npm [openssl]=openssl)
missing=()
for tool in "${!package_of[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || [[ -x /usr/sbin/$tool || -x /sbin/$tool ]] || missing+=("${package_of[$tool]}")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "missing system packages: ${missing[*]} (not root: install them with sudo apt-get install ${missing[*]})" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "missing system packages: ${missing[*]} and no apt-get here: install them by hand" >&2
  exit 1
fi
echo "installing system packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The packages' own services are not ours to run: tests start their own redis-server, haproxy
# prometheus and nginx on ports of their own. Stop and disable the packaged daemons where systemd
# started them (nginx's postinst starts one on :80 where policy-rc.d allows it).
if [[ -d /run/systemd/system ]]; then
  for service in redis-server haproxy prometheus nginx; do
    systemctl disable --now "$service" >/dev/null 2>&1 || true
  done
fi
