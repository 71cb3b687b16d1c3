#!/usr/bin/env bash
# `make demo`: a local control plane with its real nodes (e2e/cluster/up: kubelet +
# containerd running the engine image built without Docker), the CRD, the operator's
# RBAC, the operator as a host process under its own ServiceAccount token, and the
# SmolLM2 CPU sample on real pods: placed on the real nodes, its model from a
# `pvc://` claim on the model cache, sized for the two nodes. Waits until it is Ready,
# then sends a chat request through the router, to a router pod IP from the client
# Service's EndpointSlice (there is no kube-proxy) and prints the model's answer and `kubectl get -o wide`.
# `make demo-down` (this script with `down`) undoes it.
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

model_dir=$cache/models
model_file=$(sed -n 's|^ *uri: .*/\([^/]*\)$|\1|p' "$root/manifests/samples/smollm2-cpu.yaml" | head -n1)
[[ -f $model_dir/$model_file ]] || { echo "the model $model_dir/$model_file is missing: run \`make model\`" >&2; exit 1; }

echo "==> the model: a read-only claim on $model_dir (hostPath PersistentVolume)"
# The demo's namespace checks its pods against the restricted Pod Security Standard.
kubectl label namespace default pod-security.kubernetes.io/enforce=restricted --overwrite
kubectl apply -f - <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: {name: slipway-demo-models}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadOnlyMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  hostPath: {path: "$model_dir", type: Directory}
  claimRef: {namespace: default, name: models}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: models, namespace: default}
spec:
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  volumeName: slipway-demo-models
  resources: {requests: {storage: 1Gi}}
YAML

echo "==> applying the SmolLM2 CPU sample, on the real nodes"
# The sample as checked in, with what running it here takes: the model from the claim,
# the real nodes' placement, and a size for two small nodes in two zones (one group
# needed, two provisioned so that losing a zone leaves one).
kubectl patch --local -f "$root/manifests/samples/smollm2-cpu.yaml" --type merge -o yaml -p "$(cat <<JSON
{"spec": {
  "release": {
    "model": {"uri": "pvc://models/$model_file"},
    "engine": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
               "args": ["--kv-blocks", "256"]}
  },
  "capacity": {"demand": {"static": 0.5}, "replicaGoodput": 0.5,
               "faultDomain": {"topologyKey": "topology.kubernetes.io/zone", "fLoss": 0.5}},
  "podTemplate": {"nodeSelector": {"slipway.dev/node-kind": "real"},
                  "tolerations": [{"key": "slipway.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}]},
  "router": {"nodeSelector": {"slipway.dev/node-kind": "real"},
             "tolerations": [{"key": "slipway.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}]}
}}
JSON
)" | kubectl apply -f -
if ! kubectl wait --for=condition=Ready inferenceservice/smollm2 --namespace default --timeout=300s; then
  echo "smollm2 did not become Ready; pods, and the last operator log lines:" >&2
  kubectl get pods --namespace default -o wide >&2 || true
  tail -n 20 "$state/operator.log" >&2
  exit 1
fi

kubectl get inferenceservices,pods --namespace default -o wide
echo

echo "==> a chat request through the router (a ready endpoint of the client Service)"
# The client Service selects the router pods; they route to the engines' leaders.
# awk, not head: head exits after one line, and with two ready routers kubectl then
# dies of SIGPIPE, which pipefail turns into the demo failing (exit 141).
ip=""
for _ in $(seq 1 120); do
  ip=$(kubectl get endpointslices --namespace default -l kubernetes.io/service-name=smollm2 \
    -o jsonpath='{range .items[*].endpoints[?(@.conditions.ready==true)]}{.addresses[0]}{"\n"}{end}' | awk 'NR == 1')
  [[ -n $ip ]] && break
  sleep 1
done
[[ -n $ip ]] || { echo "the client Service smollm2 has no ready router endpoint after 120 s" >&2; kubectl get pods --namespace default -o wide >&2; exit 1; }
port=$(kubectl get endpointslices --namespace default -l kubernetes.io/service-name=smollm2 \
  -o jsonpath='{.items[0].ports[0].port}')
answer=$(curl --silent --show-error --fail --noproxy '*' --max-time 120 \
  "http://$ip:$port/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], "max_tokens": 48, "temperature": 0}')
echo "$answer" | python3 -c 'import json, sys; r = json.load(sys.stdin); print("model %s via the router %s: %s" % (r["model"], sys.argv[1], r["choices"][0]["message"]["content"].strip()))' "$ip:$port"
echo
echo "router metrics (TTFT, TPOT, outcomes per release): curl -s http://$ip:$port/metrics | grep slipway_router_"
echo "operator metrics: curl -s 127.0.0.1:18080/metrics; stop everything with: make demo-down"
