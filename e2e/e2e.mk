# End-to-end targets, included by the root Makefile (`-include e2e/e2e.mk`).
# Paths are relative to the repository root, where make runs. See e2e/README.md.

E2E_CLUSTER := e2e/cluster

.PHONY: e2e e2e-build e2e-images e2e-up e2e-down

e2e-build: ## compile etcd, kube-*, kubectl, kwok, kubelet, containerd, pause from source into $SLIPWAY_CACHE/k8s (once per pin set), then the engine/operator/router images
	$(E2E_CLUSTER)/build
	$(E2E_CLUSTER)/build-images

e2e-images: ## only the engine/operator/router/pause OCI images the real nodes run (release build as the Dockerfile's)
	$(E2E_CLUSTER)/build-images

e2e: e2e-build model lora-adapter ## bring the control plane up (building it if needed), run the e2e tests, tear it down
	$(CARGO) test --locked -p slipway-e2e

e2e-up: ## bring a cluster up by hand and print the KUBECONFIG to export; `make e2e` reuses it
	$(E2E_CLUSTER)/up

e2e-down: ## stop every process of the cluster by PID and remove its state
	$(E2E_CLUSTER)/down

# `make test` is "everything": the end-to-end tests are part of it.
test: e2e

# The rollout e2e (tests/rollout_e2e.rs) needs a real Prometheus: installed before any e2e test runs.
e2e-build: e2e-prometheus
e2e-prometheus:
	scripts/ensure-debian-packages prometheus=prometheus

# The operator's HTTPRoute (spec.router.httpRoute) is judged by the upstream Gateway API
# CRD: the standard channel's httproutes CRD from the sigs.k8s.io/gateway-api module,
# copied into the cache once per version. The operator e2e reads it from
# SLIPWAY_GATEWAY_API_HTTPROUTE_CRD; without it that test fails, never skips.
GATEWAY_API_VERSION := v1.6.3
GATEWAY_API_HTTPROUTE_CRD := $(SLIPWAY_CACHE)/tools/gateway-api-$(GATEWAY_API_VERSION)/gateway.networking.k8s.io_httproutes.yaml
SLIPWAY_GATEWAY_API_HTTPROUTE_CRD ?= $(GATEWAY_API_HTTPROUTE_CRD)
export SLIPWAY_GATEWAY_API_HTTPROUTE_CRD

.PHONY: gateway-api-crd
gateway-api-crd: $(SLIPWAY_GATEWAY_API_HTTPROUTE_CRD) ## the Gateway API HTTPRoute CRD (standard channel) into the cache; prints its path
	@echo $(SLIPWAY_GATEWAY_API_HTTPROUTE_CRD)

$(GATEWAY_API_HTTPROUTE_CRD):
	dir=$$(go mod download -json sigs.k8s.io/gateway-api@$(GATEWAY_API_VERSION) \
	  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$$/\1/p') && \
	  install -D -m 0644 "$$dir/config/crd/standard/$(notdir $@)" $@

e2e: $(SLIPWAY_GATEWAY_API_HTTPROUTE_CRD)
