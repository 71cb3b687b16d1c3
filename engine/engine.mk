# Engine targets, included by the root Makefile (`-include engine/engine.mk`).
# Paths are relative to the repository root, where make runs. Descriptions after
# `## ` are what `make help` lists.

ENGINE_SCRIPTS := engine/scripts

.PHONY: model fuzz-gguf

# The engine tests on the real model fail (never skip) without it, so the test
# targets fetch it first; fetch-model is a no-op once the verified file is cached.
test-unit: model

model: ## fetch (once) and sha256-verify the SmolLM2-135M-Instruct Q4_1 GGUF into $SLIPWAY_CACHE/models; prints its path
	@$(ENGINE_SCRIPTS)/fetch-model

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
