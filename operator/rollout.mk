# Rollout targets, included by the root Makefile (`-include operator/rollout.mk`).

.PHONY: rollout-test

rollout-test: ## canary rollouts: state machine tables, burn-rate math (proptest), metrics sources (scrape against real engines)
	$(CARGO) test --locked -p slipway-operator --lib rollout::
	$(CARGO) test --locked -p slipway-operator --test rollout_fixtures
	$(CARGO) build --locked -p slipway-engine --bin slipway-engine
	$(CARGO) test --locked -p slipway-operator --test rollout_scrape
