# slipway-bench targets; included from the root Makefile (`include bench/bench.mk`).
# Every target runs load against 127.0.0.1 only, bounded in count and time.
#
#   bench-llama-server  build llama.cpp's llama-server from the llama-cpp-python sdist
#                       (CPU, -j1; ~30-60 min the first time on 2 shared cores, then a no-op)
#   bench-e2e           short real sweep against llama-server on the real model:
#                       checks summary, records, plot, capacity note (~2 min once built)
#   bench-serving       Slipway vs llama-server on the issue's two workloads (a: prompts
#                       64-512, outputs 32-128 tokens; b: the same, 50% sharing a 256-token
#                       system prompt): slot probe, four sweeps, side-by-side tables, ratios,
#                       plots under ~/.cache/slipway/bench-results/<time>/ (~30-35 min once
#                       built, 45 min at most; QUICK=1: a ~4 min smoke run)
#   bench-router        slipway-router's policies (round-robin, least-in-flight, cost) on two
#                       engines: workloads P (8 tenants' system prompts, small KV pools), U
#                       (no sharing), H (one hot prefix), P with the default pool, and the
#                       router's added TTFT; rewrites router/BENCHMARKS.md (~35-40 min;
#                       QUICK=1: ~4 min smoke)
#
# Knobs: see the headers of bench/scripts/bench-serving and bench/scripts/bench-router.

.PHONY: bench-llama-server bench-e2e bench-serving

bench-llama-server: ## build llama.cpp's llama-server from the llama-cpp-python sdist (cached; slow the first time)
	bench/scripts/build-llama-server

bench-e2e: ## a short real sweep against llama-server on the real model (summary, records, plot)
	bench/scripts/bench-e2e

bench-serving: ## Slipway vs llama-server: same model, threads, workloads (a, b: 50% shared prefix) and SLO; side-by-side table, ratios, plots (~35 min; QUICK=1 ~4 min)
	bench/scripts/bench-serving

.PHONY: bench-capacity
bench-capacity: ## capacity from demand: one 3x ramp trace under static-at-peak, static-at-average and measured demand, with the operator's own decisions; group-seconds, SLO met, plot
	$(CARGO) run --locked -p slipway-bench -- capacity --out "$(SLIPWAY_CACHE)/bench-results/capacity"

.PHONY: bench-router
bench-router: ## slipway-router's policies (round-robin, least-in-flight, cost) on 2 engines: workloads P (8 tenants), U (no sharing), H (hot spot), overhead; rewrites router/BENCHMARKS.md (~25 min; QUICK=1 ~4 min)
	bench/scripts/bench-router
