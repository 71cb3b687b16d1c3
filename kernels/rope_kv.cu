// rope_kv.cu — RoPE on Q and K fused with the write of K and V into the paged cache.
//
// extern "C" __global__ void rope_store_kv(float* qkv, const u32* pos, const u32* slots,
//     u16* k_cache, u16* v_cache, int layer, int num_blocks, int block_size,
//     int n_heads, int n_kv_heads, int head_dim, int rope_dims, float theta_scale, int n)
//   qkv:   n rows of [q (n_heads*head_dim) | k (n_kv_heads*head_dim) | v (same)] floats;
//          q is rotated in place, k and v are only read.
//   pos:   n positions; slots: n cache slots (block * block_size + offset in block).
//   k_cache, v_cache: f16 bits, [layer][block][kv_head][slot][head_dim].
//   Rotation: ggml's "normal" RoPE over adjacent pairs (2i, 2i+1) for 2i < rope_dims,
//   angle pos * theta_scale^i advanced by repeated f32 multiplication as ggml does, so
//   the angles round exactly as the CPU backend's (kernels::ops::rope_table).
//   Stored values are rounded to f16 (as the CPU KV cache and llama.cpp's store them).
// Grid: (n, 1, 1). Block: (256, 1, 1); threads stride over the row's pairs.
// Min arch: sm_70. CPU twin: backend::device::twin::rope_store_kv.

extern "C" __global__ void rope_store_kv(float* qkv, const u32* pos, const u32* slots,
                                         u16* k_cache, u16* v_cache, int layer, int num_blocks,
                                         int block_size, int n_heads, int n_kv_heads,
                                         int head_dim, int rope_dims, float theta_scale, int n) {
    int t = blockIdx.x;
    if (t >= n) return;
    int width = (n_heads + 2 * n_kv_heads) * head_dim;
    float* row = qkv + (size_t)t * width;
    u32 slot = slots[t];
    size_t block = slot / block_size, off = slot % block_size;
    // Start of this position's head 0 in the layer's cache.
    size_t head_stride = (size_t)block_size * head_dim;
    size_t base = (((size_t)layer * num_blocks + block) * n_kv_heads) * head_stride + off * head_dim;
    int half = head_dim / 2;
    int pairs = (n_heads + n_kv_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int head = p / half, i = p % half;
        float* x = row + head * head_dim + 2 * i;
        float x0 = x[0], x1 = x[1];
        if (2 * i < rope_dims) {
            float theta = (float)pos[t];
            for (int j = 0; j < i; j++) theta *= theta_scale;
            float c = cosf(theta), s = sinf(theta);
            float r0 = x0 * c - x1 * s;
            float r1 = x0 * s + x1 * c;
            x0 = r0;
            x1 = r1;
        }
        if (head < n_heads) {
            x[0] = x0;
            x[1] = x1;
        } else {
            u16* k = k_cache + base + (size_t)(head - n_heads) * head_stride + 2 * i;
            k[0] = f32_to_f16(x0);
            k[1] = f32_to_f16(x1);
        }
    }
    const float* v = row + (n_heads + n_kv_heads) * head_dim;
    for (int e = threadIdx.x; e < n_kv_heads * head_dim; e += blockDim.x) {
        int h = e / head_dim, d = e % head_dim;
        v_cache[base + (size_t)h * head_stride + d] = f32_to_f16(v[e]);
    }
}
