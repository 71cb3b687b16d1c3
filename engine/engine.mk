# Engine targets, included by the root Makefile (`include engine/engine.mk`).
# Paths are relative to the repository root, where make runs.

ENGINE_SCRIPTS := engine/scripts

.PHONY: model
## model: download (once) and verify the SmolLM2-135M-Instruct Q4_1 GGUF into the cache
##        ($$SLIPWAY_CACHE, default ~/.cache/slipway); prints its path
model:
	@$(ENGINE_SCRIPTS)/fetch-model

# Fuzzing needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
# Builds go to their own target dir: sanitizer builds share nothing with the
# workspace's and would only contend for its lock.
FUZZ_SECONDS ?= 60
FUZZ_TARGET_DIR ?= $(HOME)/.cache/slipway/fuzz-target

.PHONY: fuzz-gguf
## fuzz-gguf: fuzz the GGUF reader (and the tokenizer/template built on it) for
##            $(FUZZ_SECONDS) s, starting from the checked-in seeds
fuzz-gguf:
	cd engine/fuzz && mkdir -p corpus/gguf_parse && \
	  cargo +nightly fuzz run --target-dir $(FUZZ_TARGET_DIR) gguf_parse \
	    corpus/gguf_parse seeds/gguf_parse -- \
	    -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -rss_limit_mb=2048 -timeout=10
