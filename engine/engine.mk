# Engine targets, included by the root Makefile (`-include engine/engine.mk`).
# Paths are relative to the repository root, where make runs. Descriptions after
# `## ` are what `make help` lists.

ENGINE_SCRIPTS := engine/scripts

.PHONY: model fuzz-gguf

# The engine tests on the real model fail (never skip) without it, so the test
# targets fetch it first; fetch-model is a no-op once the verified file is cached.
# engine/tests/serve_process.rs runs `promtool check metrics` on real /metrics
# output, so the test targets install promtool first (Debian `prometheus`).
test-unit: model serving-tools

# The debug engine binary is the test build (with the test-only fault injection), as
# the workspace's `cargo test` builds it, so whichever target built it last, the tests
# that start engines with --inject-* find the flags.
TEST_ENGINE_FEATURES := --features fault-injection

.PHONY: serving-tools test-serve test-openai-client
serving-tools:
	@scripts/ensure-debian-packages promtool=prometheus

test-serve: model serving-tools ## engine serving over real HTTP: drain, overload, disconnects, prefix cache, promtool, OpenAI Python client
	$(CARGO) test --locked -p slipway-engine --test serve_process $(TEST_ENGINE_FEATURES)
	$(MAKE) --no-print-directory test-openai-client

# The official OpenAI Python client (pinned in engine/tests/python/requirements.txt,
# venv under $SLIPWAY_CACHE/venv-openai) against `slipway-engine serve` on the real
# model. The engine is the test profile's build (the engine crate is optimised
# there), shared with `cargo test`.
test-openai-client: model ## the official OpenAI Python client against slipway-engine serve (chat/completions, streaming, usage, stop)
	$(CARGO) build --locked -p slipway-engine --bin slipway-engine $(TEST_ENGINE_FEATURES)
	engine/tests/python/run-openai-client $(CARGO_TARGET_DIR)/debug/slipway-engine

test: test-openai-client test-serve-smoke

.PHONY: test-serve-smoke
# engine/scripts/test-gpu's serve check (served model name, streaming chat), run here on
# the CPU so the GPU script is known to work before it first runs on a GPU machine.
test-serve-smoke: model ## test-gpu's serve check on the CPU: streaming chat under the served model name
	$(CARGO) build --locked -p slipway-engine --bin slipway-engine $(TEST_ENGINE_FEATURES)
	engine/scripts/serve-smoke $(CARGO_TARGET_DIR)/debug/slipway-engine "$$(engine/scripts/fetch-model)" cpu "$(SLIPWAY_CACHE)/serve-smoke"

model: ## fetch (once) and sha256-verify the SmolLM2-135M-Instruct Q4_1 GGUF into $SLIPWAY_CACHE/models; prints its path
	@$(ENGINE_SCRIPTS)/fetch-model

.PHONY: lora-adapter
# The LoRA tests read the adapter from the cache and llama.cpp's outputs with it from
# engine/tests/fixtures/ (checked in; llama.cpp is needed only to re-record them), so
# the test targets write the adapter first, as they fetch the model.
test-unit: lora-adapter
lora-adapter: model ## write (once) the deterministic test LoRA adapter into $SLIPWAY_CACHE/models, checked against the fixture's sha256; prints its path
	@$(ENGINE_SCRIPTS)/make-lora-adapter

# Fuzzing needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
# Its builds get their own target dir: sanitizer builds share nothing with the
# workspace's and would only contend for its lock.
FUZZ_SECONDS ?= 60
FUZZ_TARGET_DIR ?= $(HOME)/.cache/slipway/fuzz-target

fuzz-gguf: ## fuzz the GGUF reader, tokenizer and template for FUZZ_SECONDS (default 60) from the checked-in seeds
	cd engine/fuzz && mkdir -p corpus/gguf_parse && \
	  cargo +nightly fuzz run --target-dir $(FUZZ_TARGET_DIR) gguf_parse \
	    corpus/gguf_parse seeds/gguf_parse -- \
	    -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -rss_limit_mb=2048 -timeout=10

.PHONY: bench-model
# Builds llama.cpp's llama-bench/llama-batched-bench (cached under
# ~/.cache/slipway/llama.cpp) and prints our tokens/s against theirs on the same GGUF,
# same run: pp512, tg128, aggregate decode @16 and @64.
bench-model: ## our engine vs llama.cpp on the same GGUF in the same run: pp512, tg128, aggregate decode @16/@64
	@$(ENGINE_SCRIPTS)/bench-model

.PHONY: bench-parallel
# The split's cost (issue #15): single process vs pipeline 2 vs tensor 3 in one run:
# prefill and decode tok/s, µs and payload bytes per decode step per rank (ranks as
# threads over loopback TCP), and each rank's resident set as serve processes.
bench-parallel: model ## single process vs pipeline 2 vs tensor 3: tok/s, overhead per step (µs, bytes per rank), resident set per rank
	@$(ENGINE_SCRIPTS)/bench-parallel

.PHONY: serve-chat-demo
# Starts `slipway-engine serve` (release build) on the real model, asks one chat
# question with curl, prints the answer and stops the server.
serve-chat-demo: model ## start slipway-engine serve on the real model and answer one chat request
	$(CARGO) build --release --locked -p slipway-engine
	@set -e; model="$$(engine/scripts/fetch-model)"; log="$$(mktemp)"; \
	  $(CARGO_TARGET_DIR)/release/slipway-engine serve --model "$$model" --port 0 \
	    --served-model-name smollm2 >"$$log" 2>&1 & pid=$$!; \
	  trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null; rm -f "$$log"' EXIT; \
	  url="$$(scripts/wait-listening $$pid "$$log" 60)" || { cat "$$log" >&2; exit 1; }; \
	  curl -sS --fail-with-body "$$url/v1/chat/completions" -H 'content-type: application/json' \
	    -d '{"model":"smollm2","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32,"temperature":0}'; echo

.PHONY: jaeger
# The trace backend engine/tests/telemetry_process.rs exports to: Jaeger's all-in-one
# binary, built from its Go module into $SLIPWAY_CACHE/tools once per version.
# The version is the one scripts/tools/jaeger/go.mod (the wrapper module) requires.
JAEGER_VERSION := $(shell awk '$$1 == "github.com/jaegertracing/jaeger" {print $$2}' scripts/tools/jaeger/go.mod)
export SLIPWAY_JAEGER := $(SLIPWAY_CACHE)/tools/jaeger-$(JAEGER_VERSION)/jaeger
jaeger: ## build Jaeger (the OTLP trace backend of the tracing test) from its Go module, once; prints its path
	@scripts/go-tool jaeger scripts/tools/jaeger github.com/jaegertracing/jaeger/cmd/jaeger

test-unit: jaeger
