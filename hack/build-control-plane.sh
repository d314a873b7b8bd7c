#!/usr/bin/env bash
# Build the real Kubernetes control plane the tests run against: kube-apiserver, kubectl,
# etcd and helm, from Go modules, once per machine, cached by version under
# $ROLEGATE_CACHE (default $HOME/.cache/rolegate); and promtool, which checks the chart's
# alert rules and dashboard queries. Nothing built here is committed.
#
#   hack/build-control-plane.sh                 build what is missing; print the bin directory
#   hack/build-control-plane.sh --bin-dir       print the bin directory; build nothing
#   hack/build-control-plane.sh --promtool-dir  print promtool's directory; build nothing
#
# Re-running with everything built is instant. Runs that share a cache take turns on a
# lock, so a second run waits for the first and then finds the binaries built. An
# interrupted or failed build stops every process it started and leaves no binary behind
# that looks complete: each one is built into a staging directory and renamed into place.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.34.4}
ETCD_VERSION=${ETCD_VERSION:-v3.6.13}
HELM_VERSION=${HELM_VERSION:-v3.19.0}
# Prometheus 3.x's Go module versions are v0.3xx.y (v0.316.0 is Prometheus 3.16.0).
PROMETHEUS_VERSION=${PROMETHEUS_VERSION:-v0.316.0}
CACHE=${ROLEGATE_CACHE:-$HOME/.cache/rolegate}
BIN="$CACHE/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION"
TOOLS=(kube-apiserver kubectl etcd helm)
# promtool has a directory of its own, keyed by its own version, so adding or bumping it
# never rebuilds the control plane.
PROMTOOL_DIR="$CACHE/bin/prometheus-$PROMETHEUS_VERSION"
# How long a cold build took on this project's 2-core machine kind (docs/testing.md), so a
# newcomer knows what the wait is.
EXPECTED="about 10 minutes on 2 cores (15 under load)"

if [ "${1:-}" = "--bin-dir" ]; then
  echo "$BIN"
  exit 0
fi
if [ "${1:-}" = "--promtool-dir" ]; then
  echo "$PROMTOOL_DIR"
  exit 0
fi

log() { printf '[control-plane] %s\n' "$*" >&2; }

have_all() {
  local tool
  for tool in "${TOOLS[@]}"; do
    [ -x "$BIN/$tool" ] || return 1
  done
  [ -x "$PROMTOOL_DIR/promtool" ]
}

if have_all; then
  log "already built in $BIN"
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || { log "go is required (Go 1.24 or newer) to build the control plane"; exit 1; }

# Go's own caches live in ours: deleting $CACHE resets everything, an empty $CACHE is a
# truly cold build, and -modcacherw keeps the module cache deletable.
export CGO_ENABLED=0 GOFLAGS="-trimpath -modcacherw" GOTOOLCHAIN=local GOWORK=off
export GOPATH="$CACHE/go" GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build-cache"
WORK="$CACHE/build"
# What go prints (hundreds of download lines) goes here; the end of it is shown on failure.
BUILD_LOG="$CACHE/build.log"
STAGE="$BIN.partial"
mkdir -p "$CACHE"

# One build per cache at a time.
if command -v flock >/dev/null; then
  exec 9>"$CACHE/build.lock"
  if ! flock -n 9; then
    log "another build of the control plane is running in $CACHE; waiting for it to finish"
    flock 9
  fi
  if have_all; then
    log "built by the other run"
    echo "$BIN"
    exit 0
  fi
else
  log "flock not found: a concurrent build into $CACHE would not wait for this one"
fi

# Every step runs in a session of its own (setsid), so stopping a step stops the go command
# and every compiler and linker it started, and nothing else.
step_pid=""

stop_step() {
  [ -n "$step_pid" ] || return 0
  kill -TERM -- "-$step_pid" 2>/dev/null || return 0
  local waited=0
  while kill -0 -- "-$step_pid" 2>/dev/null && [ "$waited" -lt 50 ]; do
    sleep 0.1
    waited=$((waited + 1))
  done
  kill -KILL -- "-$step_pid" 2>/dev/null || true
  step_pid=""
}

cleanup() {
  local status=$?
  stop_step
  rm -rf "$STAGE"
  if [ "$status" -ne 0 ]; then
    log "build failed or was interrupted (exit $status); nothing partial was kept; run it again to resume"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

started=$SECONDS
elapsed() { printf '%dm%02ds' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)); }
# Seconds between the lines that say a long step is still going.
PROGRESS_EVERY=${ROLEGATE_BUILD_PROGRESS_SECONDS:-30}

# Run one step ("$1" says what it is), saying every $PROGRESS_EVERY seconds that it is still
# going, so a compile that prints nothing for minutes is visibly alive. A signal to this
# script is handled within the poll (0.2 s), then the trap stops the step's session.
step() {
  local what=$1
  shift
  log "$what ($(elapsed) so far)"
  setsid "$@" 2>>"$BUILD_LOG" &
  step_pid=$!
  local since=$SECONDS
  while kill -0 "$step_pid" 2>/dev/null; do
    sleep 0.2
    if [ $((SECONDS - since)) -ge "$PROGRESS_EVERY" ]; then
      log "still $what ($(elapsed) so far, $EXPECTED in all)"
      since=$SECONDS
    fi
  done
  local status=0
  wait "$step_pid" || status=$?
  step_pid=""
  if [ "$status" -ne 0 ]; then
    log "$what failed (exit $status); the end of $BUILD_LOG:"
    tail -n 40 "$BUILD_LOG" >&2
  fi
  return "$status"
}

# A finished binary moves from the staging directory into place in one rename.
install_binary() {
  mv -f "$STAGE/$1" "$BIN/$1"
}

k8s_ldflags() {
  local minor=${K8S_VERSION#v1.}
  minor=${minor%%.*}
  local pkg flags=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  done
  echo "$flags"
}

# k8s.io/kubernetes requires its staging modules at v0.0.0 through ./staging replaces
# (kubernetes/kubernetes#79384); a scratch module replaces each with the published
# v0.<minor>.<patch> instead. The list comes from the go.mod the module proxy serves ($1).
write_kubernetes_module() {
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
    grep -E '^\s*k8s.io/[^ ]+ => ./staging/' "$1" | awk -v v="$staging_version" '{print "\t" $1 " => " $1 " " v}'
    echo ")"
  } > go.mod
}

build_kubernetes() {
  local dir="$WORK/kubernetes-$K8S_VERSION"
  mkdir -p "$dir"
  cd "$dir"
  step "resolving k8s.io/kubernetes $K8S_VERSION" \
    go mod download -json "k8s.io/kubernetes@$K8S_VERSION" > kubernetes.json
  write_kubernetes_module "$(sed -n 's/.*"GoMod": "\(.*\)".*/\1/p' kubernetes.json)"
  step "downloading the modules of kube-apiserver" \
    go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@$K8S_VERSION"
  step "downloading the modules of kubectl" go get -tool "k8s.io/kubernetes/cmd/kubectl@$K8S_VERSION"
  local ldflags
  ldflags=$(k8s_ldflags)
  local tool
  for tool in kube-apiserver kubectl; do
    [ ! -x "$BIN/$tool" ] || continue
    step "building $tool" go build -ldflags "$ldflags" -o "$STAGE/$tool" "k8s.io/kubernetes/cmd/$tool"
    install_binary "$tool"
  done
}

build_etcd() {
  # A separate scratch module, so etcd's version selection does not touch the apiserver's.
  local dir="$WORK/etcd-$ETCD_VERSION"
  mkdir -p "$dir"
  cd "$dir"
  printf 'module rolegate.dev/etcd\n\ngo 1.24\n' > go.mod
  step "downloading etcd $ETCD_VERSION" go get -tool "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  step "building etcd $ETCD_VERSION" go build -o "$STAGE/etcd" go.etcd.io/etcd/server/v3
  install_binary etcd
}

build_promtool() {
  # Prometheus's go.mod has no replace directives, so `go install pkg@version` works. The
  # binary carries every service discovery's SDK: the longest single compile here.
  step "building promtool $PROMETHEUS_VERSION" \
    env GOBIN="$STAGE" go install "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION"
  mkdir -p "$PROMTOOL_DIR"
  mv -f "$STAGE/promtool" "$PROMTOOL_DIR/promtool"
}

build_helm() {
  local minor=${K8S_VERSION#v1.}
  minor=${minor%%.*}
  local pkg ldflags=""
  # Built this way helm would believe the cluster is Kubernetes 1.20; tell it the truth.
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
  done
  step "building helm $HELM_VERSION" \
    env GOBIN="$STAGE" go install -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  install_binary helm
}

log "building the real Kubernetes control plane the tests use, once for this machine"
log "($EXPECTED, 5 GB of Go caches under $CACHE; go's output in $BUILD_LOG); later runs reuse it at once"
rm -rf "$STAGE"
mkdir -p "$BIN" "$STAGE" "$WORK"
: > "$BUILD_LOG"
if [ ! -x "$BIN/etcd" ]; then build_etcd; fi
if [ ! -x "$BIN/helm" ]; then build_helm; fi
if [ ! -x "$BIN/kube-apiserver" ] || [ ! -x "$BIN/kubectl" ]; then build_kubernetes; fi
if [ ! -x "$PROMTOOL_DIR/promtool" ]; then build_promtool; fi

have_all || { log "build finished but a binary is missing in $BIN or $PROMTOOL_DIR"; exit 1; }
log "built in $(elapsed) into $BIN"
echo "$BIN"
