// matmul.cu — y = W x for quantized W (ggml Q4_1 / Q8_0 rows, as stored in the GGUF
// file) and f32 activations. Two shapes of the same product:
//
// extern "C" __global__ void matvec_q4_1(const u8* w, const float* x, float* y,
//                                        int rows, int cols, int n, int ldy, int yoff)
// extern "C" __global__ void matvec_q8_0(same)
//   Decode (few tokens): one warp per weight row; lane k dequantizes element k of each
//   32-element block, so a row's blocks are read once for up to MV_T tokens.
//   Grid: (ceil(rows / 8), ceil(n / MV_T), 1). Block: (256, 1, 1) = 8 warps = 8 rows.
// extern "C" __global__ void matmul_q4_1(same arguments)
// extern "C" __global__ void matmul_q8_0(same)
//   Prefill (many tokens): a block computes a TM × TN tile (weight rows × tokens); per
//   32-column step it dequantizes TM block-rows and TN activation slices into shared
//   memory and each thread accumulates 4 rows × 2 tokens.
//   Grid: (ceil(rows / 64), ceil(n / 32), 1). Block: (256, 1, 1). Shared: 12.4 KiB static.
// Arguments, in order: w (rows × cols/32 blocks), x (n × cols floats, row-major),
//   y (output; row t, column r lands at y[t * ldy + yoff + r], so stacked projections can
//   write side by side), rows, cols (a multiple of 32), n, ldy, yoff.
// Min arch: sm_70. CPU twin: backend::device::twin::matmul (one twin: both shapes compute
// the same sums, in a different order).

#define MV_T 8

template <int FMT>
__device__ void matvec(const u8* w, const float* x, float* y, int rows, int cols, int n, int ldy,
                       int yoff) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int t0 = blockIdx.y * MV_T;
    if (row >= rows) return;  // whole warps leave together: row is per warp
    int nb = cols / QK;
    const u8* wr = w + (size_t)row * nb * block_bytes<FMT>();
    float acc[MV_T];
#pragma unroll
    for (int t = 0; t < MV_T; t++) acc[t] = 0.0f;
    for (int b = 0; b < nb; b++) {
        float wv = dequant<FMT>(wr + b * block_bytes<FMT>(), lane);
#pragma unroll
        for (int t = 0; t < MV_T; t++) {
            if (t0 + t < n) acc[t] += wv * x[(size_t)(t0 + t) * cols + b * QK + lane];
        }
    }
#pragma unroll
    for (int t = 0; t < MV_T; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0 && t0 + t < n) y[(size_t)(t0 + t) * ldy + yoff + row] = s;
    }
}

#define TM 64
#define TN 32

template <int FMT>
__device__ void matmul_tiled(const u8* w, const float* x, float* y, int rows, int cols, int n,
                             int ldy, int yoff) {
    // +1 column of padding: consecutive rows fall in different banks.
    __shared__ float ws[TM][QK + 1];
    __shared__ float xs[TN][QK + 1];
    int tid = threadIdx.x;
    int tr = tid & 15, tn = tid >> 4;  // 16 × 16 threads; rows tr*4.., tokens tn*2..
    int row0 = blockIdx.x * TM, tok0 = blockIdx.y * TN;
    int nb = cols / QK;
    float acc[4][2];
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = 0.0f;
    for (int b = 0; b < nb; b++) {
        for (int e = tid; e < TM * QK; e += 256) {
            int r = e / QK, k = e % QK;
            int row = row0 + r;
            ws[r][k] = row < rows
                ? dequant<FMT>(w + ((size_t)row * nb + b) * block_bytes<FMT>(), k)
                : 0.0f;
        }
        for (int e = tid; e < TN * QK; e += 256) {
            int t = e / QK, k = e % QK;
            int tok = tok0 + t;
            xs[t][k] = tok < n ? x[(size_t)tok * cols + b * QK + k] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < QK; k++) {
            float xv0 = xs[tn * 2][k], xv1 = xs[tn * 2 + 1][k];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float wv = ws[tr * 4 + i][k];
                acc[i][0] += wv * xv0;
                acc[i][1] += wv * xv1;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int row = row0 + tr * 4 + i;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int tok = tok0 + tn * 2 + j;
            if (row < rows && tok < n) y[(size_t)tok * ldy + yoff + row] = acc[i][j];
        }
    }
}

extern "C" __global__ void matvec_q4_1(const u8* w, const float* x, float* y, int rows, int cols,
                                       int n, int ldy, int yoff) {
    matvec<FMT_Q4_1>(w, x, y, rows, cols, n, ldy, yoff);
}

extern "C" __global__ void matvec_q8_0(const u8* w, const float* x, float* y, int rows, int cols,
                                       int n, int ldy, int yoff) {
    matvec<FMT_Q8_0>(w, x, y, rows, cols, n, ldy, yoff);
}

extern "C" __global__ void matmul_q4_1(const u8* w, const float* x, float* y, int rows, int cols,
                                       int n, int ldy, int yoff) {
    matmul_tiled<FMT_Q4_1>(w, x, y, rows, cols, n, ldy, yoff);
}

extern "C" __global__ void matmul_q8_0(const u8* w, const float* x, float* y, int rows, int cols,
                                       int n, int ldy, int yoff) {
    matmul_tiled<FMT_Q8_0>(w, x, y, rows, cols, n, ldy, yoff);
}
