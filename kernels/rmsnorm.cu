// rmsnorm.cu — RMSNorm, optionally fused with the residual add before it.
//
// extern "C" __global__ void rms_norm(const float* x, const float* w, const u32* rows,
//                                     float* out, int dim, float eps)
//   out[i] = x[rows[i]] / sqrt(mean(x[rows[i]]^2) + eps) * w     (i = blockIdx.x)
//   `rows` selects which rows of x are normalized (the output head only needs the
//   rows whose logits were asked for; elsewhere it is the identity 0..n).
// extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w,
//                                         float* out, int dim, float eps)
//   x[i] += y[i] (the residual stream, updated in place), then out[i] = rmsnorm(x[i]) * w
// Grid: (rows, 1, 1). Block: (256, 1, 1) (any multiple of 32 up to 1024).
// Min arch: sm_70. CPU twins: backend::device::twin::{rms_norm, add_rms_norm}.
// The sum of squares is f32 per thread then a tree (the CPU backend sums in f64;
// the difference is within the stated tolerance of the twin tests).

extern "C" __global__ void rms_norm(const float* x, const float* w, const u32* rows, float* out,
                                    int dim, float eps) {
    __shared__ float red[32];
    const float* xr = x + (size_t)rows[blockIdx.x] * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int e = threadIdx.x; e < dim; e += blockDim.x) ss += xr[e] * xr[e];
    ss = block_sum(ss, red);
    float scale = rsqrtf(ss / (float)dim + eps);
    for (int e = threadIdx.x; e < dim; e += blockDim.x) o[e] = xr[e] * scale * w[e];
}

extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float* out,
                                        int dim, float eps) {
    __shared__ float red[32];
    float* xr = x + (size_t)blockIdx.x * dim;
    const float* yr = y + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int e = threadIdx.x; e < dim; e += blockDim.x) {
        float v = xr[e] + yr[e];
        xr[e] = v;
        ss += v * v;
    }
    ss = block_sum(ss, red);
    float scale = rsqrtf(ss / (float)dim + eps);
    // Each thread reads back only the elements it wrote itself: no barrier needed.
    for (int e = threadIdx.x; e < dim; e += blockDim.x) o[e] = xr[e] * scale * w[e];
}
