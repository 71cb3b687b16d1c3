# Operator targets, included by the root Makefile (`-include operator/operator.mk`).

.PHONY: demo demo-down operator-e2e image-binaries bench-operator

demo: model ## local control plane with real nodes + CRD + RBAC + operator (own token identity) + SmolLM2 sample on real pods, until Ready, then a chat answer from them
	operator/demo.sh

demo-down: ## stop the demo operator (by PID) and the local control plane
	operator/demo.sh down

operator-e2e: e2e-build ## only the operator's end-to-end tests on the real control plane
	$(CARGO) test --locked -p slipway-e2e --test operator_e2e

image-binaries: ## build slipway-operator (static, musl) and slipway-engine exactly as the Dockerfile does, and check them
	operator/scripts/build-like-dockerfile

bench-operator: ## scale benchmark on the KWOK cluster (make e2e-up first; SIZES="100 300 1000"): time to Ready, reconcile P50/P99, API req/s, CPU, RSS, then 10 % of nodes NotReady; not a test
	$(CARGO) build --release --locked -p slipway-operator
	operator/scripts/bench-operator
