# Router targets, included by the root Makefile (`-include router/router.mk`) after
# engine/engine.mk, whose TEST_ENGINE_FEATURES they reuse. Paths are relative to the
# repository root, where make runs.

.PHONY: test-router test-router-openai-client

# router/tests/engines.rs runs real `slipway-engine serve` processes: the workspace's
# `cargo test` (make test-unit) builds that binary; the router's tests alone need it
# built first.
test-router: model ## the router's tests, with those against real engines (kill, drain, canary split, prefix predictions)
	$(CARGO) build --locked -p slipway-engine --bin slipway-engine $(TEST_ENGINE_FEATURES)
	$(CARGO) test --locked -p slipway-router

# The engine's OpenAI Python client test (engine/tests/python), through the router in
# front of two engines. Fails, never skips, without python3 or the model.
test-router-openai-client: model ## the official OpenAI Python client through slipway-router in front of two engines
	$(CARGO) build --locked -p slipway-engine --bin slipway-engine $(TEST_ENGINE_FEATURES)
	$(CARGO) build --locked -p slipway-router --bin slipway-router
	engine/tests/python/run-openai-client $(CARGO_TARGET_DIR)/debug/slipway-engine $(CARGO_TARGET_DIR)/debug/slipway-router

test: test-router-openai-client
