#!/usr/bin/env bash
# Build the Kubernetes control plane the tests run against (tests/k8s/controlplane.py), once:
# kube-apiserver, kube-controller-manager, kube-scheduler (k8s.io/kubernetes, through the
# throwaway module scripts/k8s/go.mod), etcd (go.etcd.io/etcd/server/v3, same module) and kwok
# (sigs.k8s.io/kwok, go install), into ~/.cache/llmchaos/k8s/<version>/bin.
# Does nothing when that folder holds binaries built from the same go.mod, go.sum and versions.
# Go's module and build caches are Go's own (GOMODCACHE, GOCACHE): a second build for another
# folder reuses them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=k8s/versions.env
source "$here/k8s/versions.env"
out=${LLMCHAOS_K8S_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmchaos/k8s/$KUBERNETES_VERSION}
bin=$out/bin
binaries=(kube-apiserver kube-controller-manager kube-scheduler etcd kwok)
# Static binaries as Kubernetes releases them (CGO off), stripped; part of the stamp.
build_flags="CGO_ENABLED=0 -trimpath -ldflags=-s -w"
stamp_of() {
  { cat "$here/k8s/go.mod" "$here/k8s/go.sum" "$here/k8s/versions.env"; echo "$build_flags"; } \
    | sha256sum | cut -d' ' -f1
}
built() {
  [[ -f $out/stamp && $(cat "$out/stamp") == "$1" ]] || return 1
  for b in "${binaries[@]}"; do [[ -x $bin/$b ]] || return 1; done
}
stamp=$(stamp_of)
if built "$stamp"; then
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  # Outside CI the Kubernetes tests then skip, saying why; CI must run them.
  echo "build-k8s: no go command: install Go >= 1.26 to build the control plane the" \
    "Kubernetes tests run against (tests/k8s/ skip without it, and fail under CI)" >&2
  [[ -z ${CI:-} ]]
  exit
fi
grep -Eq "^\s+k8s.io/kubernetes $KUBERNETES_VERSION( |$)" "$here/k8s/go.mod" || {
  echo "build-k8s: scripts/k8s/go.mod does not require k8s.io/kubernetes $KUBERNETES_VERSION" \
    "(versions.env): regenerate it (see the README, Kubernetes tests)" >&2
  exit 1
}
grep -Eq "^\s+go.etcd.io/etcd/server/v3 $ETCD_VERSION( |$)" "$here/k8s/go.mod" || {
  echo "build-k8s: scripts/k8s/go.mod does not hold go.etcd.io/etcd/server/v3 $ETCD_VERSION" >&2
  exit 1
}
echo "build-k8s: building Kubernetes $KUBERNETES_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION" \
  "into $bin (cold: about 16 min on 2 busy cores; 35 s with Go's caches warm)" >&2
started=$(date +%s)
rm -rf "$out/stamp" "$out/tmp"
mkdir -p "$bin" "$out/tmp"
# The version the binaries report (/version, and what kube-controller-manager checks).
minor=${KUBERNETES_VERSION#v1.}
minor=${minor%%.*}
version_flags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  version_flags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1"
  version_flags+=" -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
# -buildvcs=false: the binaries do not depend on this repository's git state
export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
cd "$here/k8s"
go build -trimpath -ldflags="-s -w$version_flags" -o "$out/tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler
go build -trimpath -ldflags="-s -w" -o "$out/tmp/etcd" go.etcd.io/etcd/server/v3
cd "$out"
GOFLAGS= GOBIN="$out/tmp" go install -trimpath -ldflags="-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
for b in "${binaries[@]}"; do mv -f "$out/tmp/$b" "$bin/$b"; done
rmdir "$out/tmp"
echo "$stamp" >"$out/stamp"
echo "build-k8s: done in $(($(date +%s) - started)) s: $bin" >&2
