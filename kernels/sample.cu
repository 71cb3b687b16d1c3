// sample.cu — token choice on the device, so only token ids come back to the host.
//
// extern "C" __global__ void argmax_rows(const float* logits, int vocab, u32* out)
//   out[r] = index of the largest logit of row r (the lowest index among equal maxima,
//   as sampling::argmax). Grid: (rows, 1, 1). Block: (1024, 1, 1).
//
// extern "C" __global__ void sample_top_k_top_p(const float* logits, float* scratch,
//     int vocab, int top_k, float top_p, float temperature, const float* uniforms, u32* out)
//   The CPU Sampler's rule (sampling::Sampler::sample without penalties) for one row per
//   block: the top_k largest logits in order (value descending, index ascending), each
//   weighted exp((v - max) / temperature); keep the shortest prefix whose share reaches
//   top_p; pick the first candidate where uniforms[r] * (kept total) falls.
//   top_k in 1..=256 (the host falls back to CPU sampling otherwise), temperature > 0.
//   scratch: rows × vocab floats (a working copy; chosen logits are knocked out to -inf).
//   Method: top_k rounds of a block-wide argmax (simple and exact; fine for the small
//   top_k of chat sampling), then one thread walks the ≤ 256 candidates in f64.
//   Grid: (rows, 1, 1). Block: (1024, 1, 1).
// Min arch: sm_70. CPU twins: backend::device::twin::{argmax_rows, sample_top_k_top_p}.

#define TOPK_MAX 256

// Block-wide argmax of row[0..vocab] into (*best_v, *best_i); ties → lowest index.
__device__ void block_argmax(const float* row, int vocab, float* sv, u32* si, float* best_v,
                             u32* best_i) {
    float bv = NEG_INF;
    u32 bi = 0xffffffffu;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = row[i];
        if (v > bv || bi == 0xffffffffu) {  // first element seen, or strictly larger
            bv = v;
            bi = i;
        }
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = sv[threadIdx.x + s];
            u32 oi = si[threadIdx.x + s];
            float mv = sv[threadIdx.x];
            u32 mi = si[threadIdx.x];
            bool take = oi != 0xffffffffu && (mi == 0xffffffffu || ov > mv || (ov == mv && oi < mi));
            if (take) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    *best_v = sv[0];
    *best_i = si[0];
    __syncthreads();
}

extern "C" __global__ void argmax_rows(const float* logits, int vocab, u32* out) {
    __shared__ float sv[1024];
    __shared__ u32 si[1024];
    float v;
    u32 i;
    block_argmax(logits + (size_t)blockIdx.x * vocab, vocab, sv, si, &v, &i);
    if (threadIdx.x == 0) out[blockIdx.x] = i;
}

extern "C" __global__ void sample_top_k_top_p(const float* logits, float* scratch, int vocab,
                                              int top_k, float top_p, float temperature,
                                              const float* uniforms, u32* out) {
    __shared__ float sv[1024];
    __shared__ u32 si[1024];
    __shared__ float cand_v[TOPK_MAX];
    __shared__ u32 cand_i[TOPK_MAX];
    int r = blockIdx.x;
    const float* row = logits + (size_t)r * vocab;
    float* work = scratch + (size_t)r * vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) work[i] = row[i];
    __syncthreads();
    int k = min(min(top_k, TOPK_MAX), vocab);
    for (int c = 0; c < k; c++) {
        float v;
        u32 i;
        block_argmax(work, vocab, sv, si, &v, &i);
        if (threadIdx.x == 0) {
            cand_v[c] = v;
            cand_i[c] = i;
            work[i] = NEG_INF;
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    double total = 0.0;
    for (int c = 0; c < k; c++) total += exp((double)((cand_v[c] - cand_v[0]) / temperature));
    int keep = k;
    if (top_p < 1.0f) {
        double acc = 0.0;
        for (int c = 0; c < k; c++) {
            acc += exp((double)((cand_v[c] - cand_v[0]) / temperature)) / total;
            if (acc >= (double)top_p) {
                keep = c + 1;
                break;
            }
        }
    }
    double kept = 0.0;
    for (int c = 0; c < keep; c++) kept += exp((double)((cand_v[c] - cand_v[0]) / temperature));
    double x = (double)uniforms[r] * kept;
    u32 pick = cand_i[keep - 1];
    for (int c = 0; c < keep; c++) {
        double q = exp((double)((cand_v[c] - cand_v[0]) / temperature));
        if (x < q) {
            pick = cand_i[c];
            break;
        }
        x -= q;
    }
    out[r] = pick;
}
