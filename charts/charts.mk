# The Helm chart (charts/slipway), included by the root Makefile (`-include charts/charts.mk`).
# Its tests are e2e/tests/e2e/packaging.rs, run by `make e2e`: helm lint, helm template,
# `kubectl apply --dry-run=server` of the chart and of `-k manifests/` on the real API
# server, and the chart compared with the kustomization.

# Helm 4: Helm 3's security fixes ended on 2026-11-11. The chart (apiVersion v2) is
# also what Helm 3 reads. A cold build took 178 s on the 2-core machine, shared with
# other builds (2026-12-02); later runs reuse the cached binary.
HELM_VERSION := v4.3.2
HELM := $(SLIPWAY_CACHE)/tools/helm-$(HELM_VERSION)/helm
# The release tooling's flags, as helm's own Makefile sets them for a tagged build.
HELM_LDFLAGS := -X helm.sh/helm/v4/internal/version.version=$(HELM_VERSION) \
	-X helm.sh/helm/v4/internal/version.gitTreeState=clean

# The chart's PrometheusRule is checked against prometheus-operator's own CRD, taken
# from the module's example/ (the CRDs it publishes).
PROMETHEUS_OPERATOR_VERSION := v0.85.0
PROMETHEUS_RULE_CRD := $(SLIPWAY_CACHE)/tools/prometheus-operator-$(PROMETHEUS_OPERATOR_VERSION)/monitoring.coreos.com_prometheusrules.yaml

# The packaging tests read these; without them they fail, never skip.
SLIPWAY_HELM ?= $(HELM)
SLIPWAY_PROMETHEUS_RULE_CRD ?= $(PROMETHEUS_RULE_CRD)
export SLIPWAY_HELM SLIPWAY_PROMETHEUS_RULE_CRD

.PHONY: helm chart-files chart-files-check chart-generate

helm: $(SLIPWAY_HELM) ## build helm from its Go module into the cache (once per version)
	@echo $(SLIPWAY_HELM)

$(HELM):
	scripts/go-tool helm helm.sh/helm/v4@$(HELM_VERSION) helm.sh/helm/v4/cmd/helm '$(HELM_LDFLAGS)'

$(PROMETHEUS_RULE_CRD):
	dir=$$(go mod download -json github.com/prometheus-operator/prometheus-operator@$(PROMETHEUS_OPERATOR_VERSION) \
	  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$$/\1/p') && \
	  install -D -m 0644 "$$dir/example/prometheus-operator-crd/$(notdir $@)" $@

chart-files: ## copy the CRD, RBAC rules and monitoring files from manifests/ into charts/slipway
	charts/sync-files

chart-files-check:
	charts/sync-files --check

# `make generate` leaves the chart's copies in sync. Make runs a target's recipe after
# all its prerequisites, so the root recipe's crdgen would come after any copy made
# here: crdgen runs here first too (the second run is a no-op), after monitoring-gen.
generate: chart-generate
chart-generate: monitoring-generate
	$(CARGO) run --quiet -p slipway-api --bin crdgen
	charts/sync-files

lint: chart-files-check
e2e: $(SLIPWAY_HELM) $(SLIPWAY_PROMETHEUS_RULE_CRD)
