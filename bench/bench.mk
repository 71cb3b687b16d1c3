# slipway-bench targets; included from the root Makefile (`include bench/bench.mk`).
# Every target runs load against 127.0.0.1 only, bounded in count and time.
#
#   bench-llama-server  build llama.cpp's llama-server from the llama-cpp-python sdist
#                       (CPU, -j1; ~30-60 min the first time on 2 shared cores, then a no-op)
#   bench-e2e           short real sweep against llama-server on the real model:
#                       checks summary, records, plot, capacity note (~2 min once built)
#   bench-serving       Slipway vs llama-server: slot probe, both sweeps, side-by-side
#                       table and ratios (~25 min once built); exits non-zero, saying
#                       so, while `slipway-engine serve` does not exist
#
# Knobs: see the header of bench/scripts/bench-serving (SLOTS, RATES, DURATION, ...).

.PHONY: bench-llama-server bench-e2e bench-serving

bench-llama-server: ## build llama.cpp's llama-server from the llama-cpp-python sdist (cached; slow the first time)
	bench/scripts/build-llama-server

bench-e2e: ## a short real sweep against llama-server on the real model (summary, records, plot)
	bench/scripts/bench-e2e

bench-serving: ## Slipway vs llama-server: the same sweep against each, side-by-side table and ratios
	bench/scripts/bench-serving
