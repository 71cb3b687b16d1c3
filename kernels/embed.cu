// embed.cu — token embedding gather from a quantized table.
//
// extern "C" __global__ void embed_q8_0(const u8* table, const u32* tokens, float* out, int n, int dim)
// extern "C" __global__ void embed_q4_1(same)
//   table:  vocab rows of dim/32 ggml blocks (Q8_0: 34 bytes, Q4_1: 20 bytes each)
//   tokens: n token ids (validated < vocab on the host)
//   out:    n × dim floats, row-major
// Grid: (n, 1, 1). Block: (256, 1, 1); threads stride over the row's elements.
// Min arch: sm_70. CPU twin: backend::device::twin::embed.

template <int FMT>
__device__ void embed(const u8* table, const u32* tokens, float* out, int n, int dim) {
    int t = blockIdx.x;
    if (t >= n) return;
    int nb = dim / QK;
    const u8* row = table + (size_t)tokens[t] * nb * block_bytes<FMT>();
    for (int e = threadIdx.x; e < dim; e += blockDim.x) {
        out[(size_t)t * dim + e] = dequant<FMT>(row + (e / QK) * block_bytes<FMT>(), e % QK);
    }
}

extern "C" __global__ void embed_q8_0(const u8* table, const u32* tokens, float* out, int n, int dim) {
    embed<FMT_Q8_0>(table, tokens, out, n, dim);
}

extern "C" __global__ void embed_q4_1(const u8* table, const u32* tokens, float* out, int n, int dim) {
    embed<FMT_Q4_1>(table, tokens, out, n, dim);
}
