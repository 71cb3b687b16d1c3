#!/usr/bin/env bash
# `make demo`: a local control plane, the CRD, the operator's RBAC, the operator as a
# host process under its own ServiceAccount token, and the SmolLM2 CPU sample, waited
# on until Ready. `make demo-down` (this script with `down`) undoes it.
#
# State lives in $SLIPWAY_CACHE/demo: the operator's PID, log and kubeconfig.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${SLIPWAY_CACHE:-$HOME/.cache/slipway}
state=$cache/demo
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
mkdir -p "$state"

cluster_env() {
  # `up` is idempotent and prints the two exports to use.
  # (Its progress goes to stderr; keep it in a log and take the exports.)
  eval "$("$root/e2e/cluster/up" 2>&1 | tee "$state/up.log" | grep -E '^\s*export ')"
}

stop_operator() {
  if [[ -f $state/operator.pid ]]; then
    pid=$(cat "$state/operator.pid")
    # Only signal the PID we recorded, and only while it still runs our binary.
    if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q slipway-operator; then
      kill -TERM "$pid"
      # Graceful shutdown releases the Lease; SIGKILL only if it hangs.
      timeout 15 tail --pid="$pid" -f /dev/null || kill -KILL "$pid"
    fi
    rm -f "$state/operator.pid"
  fi
}

if [[ ${1:-up} == down ]]; then
  stop_operator
  "$root/e2e/cluster/down"
  rm -rf "$state"
  echo "demo is down"
  exit 0
fi

if [[ -n ${SLIPWAY_OPERATOR_BIN:-} ]]; then
  bin=$SLIPWAY_OPERATOR_BIN
else
  echo "==> building slipway-operator"
  cargo build --quiet -p slipway-operator --bin slipway-operator
  bin=$CARGO_TARGET_DIR/debug/slipway-operator
fi

echo "==> bringing up the local control plane"
cluster_env

echo "==> installing the CRD and the operator's RBAC"
kubectl apply --server-side -f "$root/manifests/crds/"
kubectl wait --for=condition=Established crd/inferenceservices.slipway.dev --timeout=60s
kubectl apply -f "$root/manifests/operator/namespace.yaml"
kubectl apply -f "$root/manifests/rbac/"

echo "==> minting a token for ServiceAccount slipway-system/slipway-operator"
token=$(kubectl create token slipway-operator --namespace slipway-system --duration 2h)
server=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.server}')
ca_data=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
if [[ -z $ca_data ]]; then
  ca_file=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority}')
  ca_data=$(base64 -w0 < "$ca_file")
fi
umask 077
cat > "$state/operator.kubeconfig" <<CFG
apiVersion: v1
kind: Config
clusters: [{name: demo, cluster: {server: "$server", certificate-authority-data: "$ca_data"}}]
users: [{name: slipway-operator, user: {token: "$token"}}]
contexts: [{name: demo, context: {cluster: demo, user: slipway-operator, namespace: slipway-system}}]
current-context: demo
CFG

echo "==> starting the operator (log: $state/operator.log)"
stop_operator
KUBECONFIG=$state/operator.kubeconfig nohup "$bin" \
  --metrics-addr 127.0.0.1:18080 --lease-namespace slipway-system --identity demo-operator \
  > "$state/operator.log" 2>&1 &
echo $! > "$state/operator.pid"

echo "==> applying the SmolLM2 CPU sample"
kubectl apply -f "$root/manifests/samples/smollm2-cpu.yaml"
if ! kubectl wait --for=condition=Ready inferenceservice/smollm2 --namespace default --timeout=120s; then
  echo "smollm2 did not become Ready; last operator log lines:" >&2
  tail -n 20 "$state/operator.log" >&2
  exit 1
fi

kubectl get inferenceservices,pods --namespace default -o wide
echo
kubectl get inferenceservice smollm2 --namespace default -o jsonpath='{.status}' | python3 -m json.tool
echo
echo "operator metrics: curl -s 127.0.0.1:18080/metrics; stop everything with: make demo-down"
