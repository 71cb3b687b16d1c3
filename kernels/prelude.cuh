// prelude.cuh — helpers prepended to every kernel file before NVRTC compiles it
// (by engine/src/backend/cuda/sources.rs at start-up and by engine/scripts/check-kernels).
// No toolkit headers: NVRTC provides the device built-ins (__shfl_xor_sync, expf, ...),
// and f16 <-> f32 conversion is one PTX `cvt` each (round-to-nearest-even, like the
// `half` crate the CPU twins use), so no cuda_fp16.h is needed.
// Minimum architecture: sm_70 (the *_sync warp shuffles).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// -inf without math.h.
#define NEG_INF __int_as_float(0xff800000)

// ggml block formats (see engine/src/kernels/quant.rs).
#define QK 32
#define Q4_1_BYTES 20  // d: f16, m: f16, qs[16]: element j low nibble of qs[j], j+16 high nibble
#define Q8_0_BYTES 34  // d: f16, qs[32]: signed bytes
#define FMT_Q4_1 0
#define FMT_Q8_0 1

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Reads a little-endian f16 at a 2-byte-aligned address (both block formats keep
// their scales 2-byte aligned: block sizes 20 and 34 are even).
__device__ __forceinline__ float load_f16(const u8* p) {
    return f16_to_f32(*(const u16*)p);
}

// Element k (0..31) of one quantized block.
template <int FMT>
__device__ __forceinline__ float dequant(const u8* blk, int k) {
    if (FMT == FMT_Q4_1) {
        u8 q = blk[4 + (k & 15)];
        int v = (k < 16) ? (q & 15) : (q >> 4);
        return (float)v * load_f16(blk) + load_f16(blk + 2);
    } else {
        return (float)(signed char)blk[2 + k] * load_f16(blk);
    }
}

template <int FMT>
__device__ __forceinline__ int block_bytes() {
    return FMT == FMT_Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every
// thread gets the result. `shared` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    v = (lane < nw) ? shared[lane] : 0.0f;
    return warp_sum(v);
}
