// attention.cu — causal grouped-query attention over the paged KV cache, one query
// token per (grid.x) row: decode steps and prefill chunks use the same kernel (a
// prefill token at position p attends to positions 0..=p, all of which
// rope_store_kv wrote earlier in the same layer).
//
// extern "C" __global__ void paged_attention(const float* qkv, const u16* k_cache,
//     const u16* v_cache, const u32* block_tables, const u32* table_off, const u32* pos,
//     float* out, int layer, int num_blocks, int block_size, int n_heads, int n_kv_heads,
//     int head_dim, float scale, int n)
//   qkv: n rows of [q | k | v] (q already rotated); query head h reads KV head
//        h / (n_heads / n_kv_heads) (GQA: SmolLM2-135M has 9 query heads on 3 KV heads).
//   block_tables: all sequences' block ids back to back; token t's table starts at
//        table_off[t]; position p lives in block table[p / block_size], slot p % block_size.
//   out: n × (n_heads * head_dim) floats.
//   Method: one warp per (token, query head); the context is walked 32 positions at a
//   time, lane j scoring position c + j against the whole query (held in shared memory),
//   with the online softmax of Milakov & Gimelshein (2018) as in FlashAttention, then
//   each lane accumulates head_dim / 32 output dimensions.
//   The query is rounded to f16 before scaling, as the CPU backend (and llama.cpp,
//   which multiplies f16 keys by an f16 query) do.
// Grid: (n, n_heads, 1). Block: (32, 1, 1). head_dim: a multiple of 32, at most 256.
// Min arch: sm_70. CPU twin: backend::device::twin::paged_attention.

#define HD_MAX 256

extern "C" __global__ void paged_attention(const float* qkv, const u16* k_cache,
                                           const u16* v_cache, const u32* block_tables,
                                           const u32* table_off, const u32* pos, float* out,
                                           int layer, int num_blocks, int block_size,
                                           int n_heads, int n_kv_heads, int head_dim,
                                           float scale, int n) {
    __shared__ float q[HD_MAX];
    int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    if (t >= n || head_dim > HD_MAX || head_dim % 32 != 0) return;
    int kvh = h / (n_heads / n_kv_heads);
    int width = (n_heads + 2 * n_kv_heads) * head_dim;
    const float* qr = qkv + (size_t)t * width + h * head_dim;
    for (int d = lane; d < head_dim; d += 32) q[d] = f16_to_f32(f32_to_f16(qr[d])) * scale;
    __syncwarp();
    const u32* table = block_tables + table_off[t];
    int ctx = (int)pos[t] + 1;
    size_t head_stride = (size_t)block_size * head_dim;
    size_t layer_base = (size_t)layer * num_blocks * n_kv_heads * head_stride;
    int nd = head_dim / 32;
    float acc[HD_MAX / 32];
#pragma unroll
    for (int i = 0; i < HD_MAX / 32; i++) acc[i] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (int c = 0; c < ctx; c += 32) {
        int p = c + lane;
        float s = NEG_INF;
        if (p < ctx) {
            size_t at = layer_base + ((size_t)table[p / block_size] * n_kv_heads + kvh) * head_stride
                + (size_t)(p % block_size) * head_dim;
            s = 0.0f;
            for (int d = 0; d < head_dim; d++) s += q[d] * f16_to_f32(k_cache[at + d]);
        }
        float m_new = fmaxf(m, warp_max(s));
        float e = (p < ctx) ? expf(s - m_new) : 0.0f;
        float corr = expf(m - m_new);  // m = -inf on the first chunk: corr = 0, acc = 0
        l = l * corr + warp_sum(e);
#pragma unroll
        for (int i = 0; i < HD_MAX / 32; i++) acc[i] *= corr;
        int last = min(32, ctx - c);
        for (int j = 0; j < last; j++) {
            float ej = __shfl_sync(0xffffffffu, e, j);
            int pj = c + j;
            size_t at = layer_base + ((size_t)table[pj / block_size] * n_kv_heads + kvh) * head_stride
                + (size_t)(pj % block_size) * head_dim;
#pragma unroll
            for (int i = 0; i < HD_MAX / 32; i++) {
                if (i < nd) acc[i] += ej * f16_to_f32(v_cache[at + lane + 32 * i]);
            }
        }
        m = m_new;
    }
    float* o = out + (size_t)t * n_heads * head_dim + h * head_dim;
#pragma unroll
    for (int i = 0; i < HD_MAX / 32; i++) {
        if (i < nd) o[lane + 32 * i] = acc[i] / l;
    }
}
