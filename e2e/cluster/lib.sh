# Shared helpers for e2e/cluster scripts. Sourced, never executed.
# shellcheck shell=bash

CLUSTER_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=pins.env
source "${CLUSTER_DIR}/pins.env"

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Compare dotted versions: version_ge 1.26.8 1.26.0
version_ge() {
  [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$2" ]
}

# Use the machine's Go unless a wrapper module asks for a newer language version;
# then let Go fetch the pinned toolchain through the module proxy.
select_go_toolchain() {
  command -v go >/dev/null || die "go is not installed; the control plane is built from source with Go"
  local have need mod
  have="$(go env GOVERSION | sed 's/^go//')"
  need=0
  for mod in "${CLUSTER_DIR}"/modules/*/go.mod; do
    [ -f "$mod" ] || continue
    local v
    v="$(awk '$1 == "go" {print $2; exit}' "$mod")"
    if ! version_ge "$need" "$v"; then need="$v"; fi
  done
  if version_ge "$have" "$need"; then
    export GOTOOLCHAIN=local
  else
    log "local Go ${have} is older than ${need} required by a wrapper module; using ${GO_TOOLCHAIN_FALLBACK}"
    export GOTOOLCHAIN="${GO_TOOLCHAIN_FALLBACK}"
  fi
}

# Cache key: the pins plus the exact dependency graph (go.sum) of every wrapper,
# so editing a pin or re-syncing a module invalidates the cache.
# CoreDNS is built and cached apart (coredns_bin below): neither its pin, which closes
# pins.env after APART_MARKER, nor its wrapper module is part of this key, so pinning
# another CoreDNS never rebuilds the control plane.
CONTROL_PLANE_MODULES=(containerd etcd kubernetes kwok)
APART_MARKER='# --- Built and cached apart from the control plane'
cache_key() {
  local sum m files=()
  for m in "${CONTROL_PLANE_MODULES[@]}"; do files+=("${CLUSTER_DIR}/modules/${m}/go.mod"); done
  for m in "${CONTROL_PLANE_MODULES[@]}"; do files+=("${CLUSTER_DIR}/modules/${m}/go.sum"); done
  sum="$( { sed "/^${APART_MARKER}/,\$d" "${CLUSTER_DIR}/pins.env"; cat "${files[@]}"; } \
    | sha256sum | cut -c1-12)"
  printf 'k8s-%s_etcd-%s_kwok-%s_%s' "${K8S_VERSION}" "${ETCD_VERSION}" "${KWOK_VERSION}" "${sum}"
}

# The Makefile exports SLIPWAY_CACHE (default ~/.cache/slipway) for every cache.
slipway_cache() { printf '%s' "${SLIPWAY_CACHE:-${HOME}/.cache/slipway}"; }

# CoreDNS (the real nodes' cluster DNS), built by ./build from modules/coredns (a main
# package importing only the plugins ./real-nodes' Corefile uses) into a directory
# keyed by its pin and that module's files.
coredns_bin() {
  local sum
  sum="$(cat "${CLUSTER_DIR}"/modules/coredns/{go.mod,go.sum,main.go} | sha256sum | cut -c1-12)"
  printf '%s/tools/coredns-%s-%s/coredns' "$(slipway_cache)" "${COREDNS_VERSION}" "$sum"
}
cache_root() { printf '%s' "${SLIPWAY_K8S_CACHE:-$(slipway_cache)/k8s}"; }
cache_dir() { printf '%s/%s' "$(cache_root)" "$(cache_key)"; }
bin_dir() { printf '%s/bin' "$(cache_dir)"; }

REQUIRED_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok kwokctl
  kubelet containerd containerd-shim-runc-v2 ctr pause)

# Debian packages the real nodes use, as `command=package` for
# scripts/ensure-debian-packages: the OCI runtime, the CNI plugins (bridge,
# host-local, loopback, portmap) and socat (the nodes reach the API server's
# loopback port through a Unix socket, see ./up).
NODE_PACKAGES=(runc=runc /usr/lib/cni/bridge=containernetworking-plugins socat=socat)
CNI_BIN_DIR=/usr/lib/cni
# Service ClusterIPs. There is no kube-proxy: only the first address, the kubernetes
# Service (the API server), is answered, inside each real node (./real-nodes), so that
# pods which watch the API (the router) reach it as they would in any cluster.
# A /16: every InferenceService takes two ClusterIPs (client and per-release
# Services), so the default /24 ran out near 120 of them; `make bench-operator`
# creates 1,000 (2,000 addresses).
SERVICE_CIDR=10.0.0.0/16
KUBERNETES_SERVICE_IP=10.0.0.1
# Cluster DNS, as kubeadm numbers it: the kube-dns Service (kube-system) holds this
# ClusterIP, and a CoreDNS inside each real node answers on it (./real-nodes).
CLUSTER_DNS_IP=10.0.0.10
CLUSTER_DOMAIN=cluster.local

# Where `up` keeps a cluster: kwokctl's work dir (pids/, logs/, etcd data, pki,
# kubeconfig). Outside the repository, one directory per cluster name.
CLUSTER_NAME="${SLIPWAY_E2E_CLUSTER:-slipway-e2e}"
state_root() { printf '%s' "${SLIPWAY_E2E_STATE:-$(slipway_cache)/e2e-clusters}"; }
cluster_workdir() { printf '%s/clusters/%s' "$(state_root)" "${CLUSTER_NAME}"; }
admin_kubeconfig() { printf '%s/admin.kubeconfig' "$(cluster_workdir)"; }

# The pause image's tag: TAG in build/pause/Makefile of the pinned Kubernetes module.
pause_tag() { # <k8s.io/kubernetes module dir>
  local tag
  tag="$(sed -n 's/^TAG ?= *//p' "$1/build/pause/Makefile" | head -n1)"
  [ -n "$tag" ] || die "no TAG in $1/build/pause/Makefile"
  printf '%s' "$tag"
}

# Images for the real nodes (./build-images): $SLIPWAY_CACHE/images.
images_dir() { printf '%s/images' "$(slipway_cache)"; }
# The sandbox image's name: local (never pulled), tagged with the version the
# pause binary reports ("pause.c v3.10.2-slipway" -> 3.10.2).
pause_image_name() {
  local version
  version="$("$(bin_dir)/pause" -v 2>&1 | sed -n 's/^pause\.c v\([0-9][0-9.]*\).*/\1/p')"
  [ -n "$version" ] || die "$(bin_dir)/pause -v did not report a version"
  printf 'localhost/slipway/pause:%s' "$version"
}
