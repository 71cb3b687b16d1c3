# The one task runner for people and CI. CI runs `.ci/run`, which calls these targets.
#
# Builds are cached outside the repository so a fresh clone reuses them.
SLIPWAY_CACHE ?= $(HOME)/.cache/slipway
export SLIPWAY_CACHE
export CARGO_TARGET_DIR ?= $(SLIPWAY_CACHE)/target
CARGO ?= cargo

.PHONY: help generate lint test test-unit prune-cache

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | sort

generate: ## regenerate the CRD in manifests/crds/ from the API types
	$(CARGO) run --quiet -p slipway-api --bin crdgen

lint: ## rustfmt check, clippy with -D warnings, CRD drift check
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(CARGO) run --quiet -p slipway-api --bin crdgen -- --check

prune-cache: ## drop stale test binaries and incremental state from the build cache (CI does this when it is large)
	scripts/prune-build-cache --force

test-unit: ## unit, property and engine tests of the default workspace members
	$(CARGO) test --locked

test: test-unit ## everything: unit tests and the end-to-end tests

# Component fragments: each adds its own targets (model, bench-*, e2e, ...).
-include engine/engine.mk engine/cuda.mk router/router.mk bench/bench.mk e2e/e2e.mk operator/operator.mk operator/rollout.mk charts/charts.mk
# The SLO rules and dashboard: generate, lint (drift) and test (promtool) hooks.
-include manifests/monitoring/monitoring.mk
