# Rollout targets, included by the root Makefile (`-include operator/rollout.mk`).

.PHONY: rollout-test

rollout-test: ## canary rollouts: state machine tables, burn-rate math (proptest), metrics sources
	$(CARGO) test --locked -p slipway-operator --lib rollout::
	$(CARGO) test --locked -p slipway-operator --test rollout_fixtures
