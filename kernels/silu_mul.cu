// silu_mul.cu — SwiGLU activation on the stacked [gate | up] rows.
//
// extern "C" __global__ void silu_mul(const float* gate_up, float* out, int ffn, int n)
//   out[t][j] = silu(gate_up[t][j]) * gate_up[t][ffn + j],  silu(g) = g / (1 + e^-g)
// Grid: (ceil(n*ffn / 256), 1, 1). Block: (256, 1, 1).
// Min arch: sm_70. CPU twin: backend::device::twin::silu_mul.

extern "C" __global__ void silu_mul(const float* gate_up, float* out, int ffn, int n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * ffn) return;
    size_t t = i / ffn, j = i % ffn;
    float g = gate_up[t * 2 * ffn + j];
    float u = gate_up[t * 2 * ffn + ffn + j];
    out[i] = g / (1.0f + expf(-g)) * u;
}

// extern "C" __global__ void add(float* x, const float* y, int len)
//   x[i] += y[i] (the last residual add, before the output norm)
// Grid: (ceil(len / 256), 1, 1). Block: (256, 1, 1).
extern "C" __global__ void add(float* x, const float* y, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] += y[i];
}
