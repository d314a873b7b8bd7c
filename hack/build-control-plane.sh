#!/usr/bin/env bash
# Build the real Kubernetes control plane the tests run against: kube-apiserver, kubectl,
# etcd and helm, from Go modules, once per machine, cached by version under
# $ROLEGATE_CACHE (default $HOME/.cache/rolegate). Nothing built here is committed.
#
# Prints the bin directory on stdout when done. Re-running with everything built is instant.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.34.4}
ETCD_VERSION=${ETCD_VERSION:-v3.6.13}
HELM_VERSION=${HELM_VERSION:-v3.19.0}
CACHE=${ROLEGATE_CACHE:-$HOME/.cache/rolegate}
BIN="$CACHE/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION"
WORK="$CACHE/build"

export CGO_ENABLED=0 GOFLAGS=-trimpath GOTOOLCHAIN=local GOWORK=off

log() { printf '[control-plane] %s\n' "$*" >&2; }

have_all() {
  for tool in kube-apiserver kubectl etcd helm; do
    [ -x "$BIN/$tool" ] || return 1
  done
}

if have_all; then
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || { log "go is required (Go 1.24 or newer) to build the control plane"; exit 1; }
mkdir -p "$BIN" "$WORK"
started=$(date +%s)

build_kubernetes() {
  local dir="$WORK/kubernetes-$K8S_VERSION"
  mkdir -p "$dir"
  cd "$dir"
  # k8s.io/kubernetes requires its staging modules at v0.0.0 through ./staging replaces
  # (kubernetes/kubernetes#79384); a scratch module replaces each with the published
  # v0.<minor>.<patch> instead. The list comes from the go.mod the module proxy serves.
  local gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  local staging_version="v0${K8S_VERSION#v1}"
  {
    echo "module rolegate.dev/controlplane"
    echo
    echo "go 1.24"
    echo
    echo "godebug default=go1.24"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    grep -E '^\s*k8s.io/[^ ]+ => ./staging/' "$gomod" | awk -v v="$staging_version" '{print "\t" $1 " => " $1 " " v}'
    echo ")"
  } > go.mod
  log "resolving k8s.io/kubernetes $K8S_VERSION modules"
  go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@$K8S_VERSION" >&2
  go get -tool "k8s.io/kubernetes/cmd/kubectl@$K8S_VERSION" >&2
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  local ldflags=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  done
  log "building kube-apiserver"
  go build -ldflags "$ldflags" -o "$BIN/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
  log "building kubectl"
  go build -ldflags "$ldflags" -o "$BIN/kubectl" k8s.io/kubernetes/cmd/kubectl
}

build_etcd() {
  # A separate scratch module, so etcd's version selection does not touch the apiserver's.
  local dir="$WORK/etcd-$ETCD_VERSION"
  mkdir -p "$dir"
  cd "$dir"
  printf 'module rolegate.dev/etcd\n\ngo 1.24\n' > go.mod
  log "building etcd $ETCD_VERSION"
  go get -tool "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
  go build -o "$BIN/etcd" go.etcd.io/etcd/server/v3
}

build_helm() {
  log "building helm $HELM_VERSION"
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  local ldflags=""
  # Built this way helm would believe the cluster is Kubernetes 1.20; tell it the truth.
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
  done
  GOBIN="$BIN" go install -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
}

[ -x "$BIN/etcd" ] || build_etcd
[ -x "$BIN/helm" ] || build_helm
{ [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kubectl" ]; } || build_kubernetes

have_all || { log "build finished but a binary is missing in $BIN"; exit 1; }
log "built in $(( $(date +%s) - started ))s into $BIN"
echo "$BIN"
