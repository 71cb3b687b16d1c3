# CUDA backend targets, included by the root Makefile (`-include engine/cuda.mk`).
#
# check-kernels runs everywhere (no GPU, driver or toolkit needed) and is part of
# test-unit. test-gpu and bench-gpu run ON the GPU machine, from what
# engine/scripts/gpu-stage prepared here (binaries built for x86-64, the model in two
# parts, the oracle); engine/scripts/gpu-stage prints the device calls to make.

.PHONY: check-kernels test-gpu bench-gpu gpu-stage

check-kernels: ## compile every kernels/*.cu with NVRTC (PyPI wheel) for sm_90, ptxas registers/spills per kernel; build and lint --features cuda
	@engine/scripts/check-kernels
	$(CARGO) clippy -p slipway-engine --features cuda --all-targets --locked -- -D warnings

test-unit: check-kernels

gpu-stage: ## build the GPU test/bench binaries and split the model into .gpu/ for the device machine (prints the calls to make)
	@engine/scripts/gpu-stage

test-gpu: ## ON THE GPU MACHINE: kernels vs CPU twins, teacher-forced agreement with the CPU backend, streaming chat from serve --device cuda
	@engine/scripts/test-gpu

bench-gpu: ## ON THE GPU MACHINE: decode tok/s (1, 16/64/256 streams) and prefill tok/s vs transformers fp16 on the same GPU
	@engine/scripts/bench-gpu
