// The fp8_decode GEMM kernel: y[token, g, o] = Σ_k x[token, g, k] · (e4m3 W[g, o, k] · scale),
// swap-AB on mma.sync m16n8k16 (weight rows are the MMA's M side, tokens its N side, so a decode
// step's few tokens waste no tensor-core rows). A block owns kBlockRows weight rows of one group
// and one K split; its four warps own 16 rows each and every token. Weight tiles (kBlockRows x
// kBlockK bytes) and the matching bf16 activation tiles stream through a kStages-deep cp.async
// pipeline; each thread converts its e4m3 codes to bf16 in registers with the block scale (the
// f32 product rounded to bf16: exact for power-of-two scales), so every weight byte is read from
// memory once per call.
//
// K order: lane (g, c) of a warp holds MMA k slots {2c, 2c+1, 2c+8, 2c+9}; here it owns 16
// consecutive channels (one 16-byte chunk of codes) and feeds them to four MMAs as slots 2c, 2c+1
// <- channels 4j, 4j+1 and 2c+8, 2c+9 <- 4j+2, 4j+3 (MMA j). A and B use the same permutation, so
// each MMA still sums 16 distinct channels; only the fp32 summation order differs from a plain K
// loop, and it is fixed: bits never depend on the launch, the other tokens or the token count.
//
// Split-K: with splits > 1 every split writes its fp32 partial sums to `partial`, and
// linear_fp8_decode.cu's reduction adds the splits in ascending order.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ops/attention/mma/mma_fragments.cuh"
#include "cuda/ops/projection/linear_implementations.h"

namespace dsv4::cuda {

inline constexpr int kFp8DecodeBlockRows = 64;   // weight rows per block: 4 warps x 16
inline constexpr int kFp8DecodeBlockK = 128;     // input channels per pipeline stage
inline constexpr int kFp8DecodeStages = 4;
inline constexpr int kFp8DecodeThreads = 128;

// Shared memory of a block serving up to 8 · token_tiles tokens.
constexpr int fp8_decode_stage_bytes(int token_tiles) {
  return kFp8DecodeBlockRows * kFp8DecodeBlockK + 8 * token_tiles * kFp8DecodeBlockK * 2;
}
constexpr int fp8_decode_shared_bytes(int token_tiles) { return kFp8DecodeStages * fp8_decode_stage_bytes(token_tiles); }

struct Fp8DecodeLaunch {
  const uint16_t* x = nullptr;    // [rows, groups, in] bf16, 16-byte aligned
  const uint8_t* weight = nullptr;  // [groups, out, in] e4m3, 16-byte aligned
  const void* scale = nullptr;    // ue8m0 bytes or f32
  bool ue8m0_scale = true;
  ScaleRows scale_rows;
  int scale_cols = 0;
  int block_in = 0;               // a multiple of 16
  int rows = 0, groups = 0, out = 0, in = 0;  // in: a multiple of 16
  int splits = 1;
  int split_k = 0;                // channels per split, a multiple of kFp8DecodeBlockK
  void* y = nullptr;              // splits == 1: [rows, groups, out]
  DType y_dtype = DType::bf16;
  float* partial = nullptr;       // splits > 1: [splits, rows, groups, out] f32
};

namespace fp8_decode {

__device__ __forceinline__ uint4 load_shared16(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address));
  return v;
}

// Two floats as a bf16 pair, rounded to nearest even (as float_to_bf16_bits), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// Two e4m3 codes (the low byte first) as floats, exactly (NaN stays NaN): cvt.rn.f16x2.e4m3x2 on
// sm_89+, else the header's software decode; the f16 values widen exactly to f32.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t codes) {
  const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes & 0xffff), __NV_E4M3);
  return __half22float2(__half2(pair));
}

// Four e4m3 codes (the low byte first) times `scale`, rounded to bf16: pairs (0, 1) and (2, 3).
__device__ __forceinline__ void e4m3x4_to_bf16(uint32_t codes, float scale, uint32_t& pair01, uint32_t& pair23) {
  const float2 f01 = e4m3x2_to_float2(codes), f23 = e4m3x2_to_float2(codes >> 16);
  pair01 = pack_bf16x2(f01.x * scale, f01.y * scale);
  pair23 = pack_bf16x2(f23.x * scale, f23.y * scale);
}

__device__ __forceinline__ float block_scale(const Fp8DecodeLaunch& a, int64_t scale_row, int k) {
  const int64_t i = scale_row * a.scale_cols + min(k / a.block_in, a.scale_cols - 1);
  return a.ue8m0_scale ? ue8m0_to_float(static_cast<const uint8_t*>(a.scale)[i]) : static_cast<const float*>(a.scale)[i];
}

// Shared layouts, 16-byte chunks swizzled so that a quarter warp's 16-byte loads fall on 8
// different bank groups: weight row r (128 bytes) keeps chunk c at c ^ 4·(r % 2) (two rows of four
// chunks per quarter warp); token n (256 bytes) keeps chunk c at c ^ (n % 2).
__device__ __forceinline__ uint32_t weight_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * kFp8DecodeBlockK + ((chunk ^ ((row & 1) << 2)) << 4));
}
__device__ __forceinline__ uint32_t token_offset(int token, int chunk) {
  return static_cast<uint32_t>(token * kFp8DecodeBlockK * 2 + ((chunk ^ (token & 1)) << 4));
}

}  // namespace fp8_decode

// Grid: (ceil(out / kBlockRows), groups, splits); kTokenTiles · 8 >= rows.
template <int kTokenTiles>
__global__ void __launch_bounds__(kFp8DecodeThreads) linear_fp8_decode_kernel(const Fp8DecodeLaunch a) {
  using namespace fp8_decode;
  constexpr int kTokens = 8 * kTokenTiles;
  constexpr int kStageBytes = fp8_decode_stage_bytes(kTokenTiles);
  constexpr int kWeightTileBytes = kFp8DecodeBlockRows * kFp8DecodeBlockK;
  constexpr int kWeightChunks = kWeightTileBytes / 16;          // 512: 4 per thread
  constexpr int kTokenChunks = kTokens * kFp8DecodeBlockK * 2 / 16;  // 128 per token tile: 1 per thread
  static_assert(kWeightChunks % kFp8DecodeThreads == 0 && kTokenChunks % kFp8DecodeThreads == 0);
  extern __shared__ __align__(16) unsigned char shared[];
  const uint32_t base = shared_address(shared);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m0 = blockIdx.x * kFp8DecodeBlockRows, g = blockIdx.y, split = blockIdx.z;
  const int k_begin = split * a.split_k;
  const int k_end = min(a.in, k_begin + a.split_k);
  const int steps = (k_end - k_begin + kFp8DecodeBlockK - 1) / kFp8DecodeBlockK;
  const uint8_t* weight = a.weight + (static_cast<int64_t>(g) * a.out) * a.in;

  const auto load_stage = [&](int step) {
    const uint32_t stage = base + static_cast<uint32_t>((step % kFp8DecodeStages) * kStageBytes);
    const int k0 = k_begin + step * kFp8DecodeBlockK;
#pragma unroll
    for (int i = 0; i < kWeightChunks / kFp8DecodeThreads; ++i) {
      const int c = tid + i * kFp8DecodeThreads, row = c / 8, chunk = c % 8;
      const int o = m0 + row, k = k0 + chunk * 16;
      const bool valid = o < a.out && k < k_end;
      cp_async<16>(stage + weight_offset(row, chunk), valid ? weight + static_cast<int64_t>(o) * a.in + k : a.weight,
                       valid);
    }
#pragma unroll
    for (int i = 0; i < kTokenChunks / kFp8DecodeThreads; ++i) {
      const int c = tid + i * kFp8DecodeThreads, token = c / 16, chunk = c % 16;
      const int k = k0 + chunk * 8;
      const bool valid = token < a.rows && k < k_end;
      cp_async<16>(stage + kWeightTileBytes + token_offset(token, chunk),
                       valid ? a.x + (static_cast<int64_t>(token) * a.groups + g) * a.in + k : a.x, valid);
    }
  };

  // This lane's weight rows (tile rows r0 and r0 + 8 of its warp) and their scale rows.
  const int group_lane = lane / 4, c = lane % 4;
  const int r0 = warp * 16 + group_lane, r1 = r0 + 8;
  const int64_t scale_row0 = a.scale_rows.row(g, min(m0 + r0, a.out - 1));
  const int64_t scale_row1 = a.scale_rows.row(g, min(m0 + r1, a.out - 1));

  float acc[kTokenTiles][4];
#pragma unroll
  for (int t = 0; t < kTokenTiles; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;

#pragma unroll
  for (int s = 0; s < kFp8DecodeStages - 1; ++s) {
    if (s < steps) load_stage(s);
    cp_async_commit();
  }
  for (int step = 0; step < steps; ++step) {
    const int k0 = k_begin + step * kFp8DecodeBlockK;
    // The block scales of this lane's rows and channels, fetched while the stage lands.
    float scales[2][2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int k = k0 + (half * 4 + c) * 16;
      scales[half][0] = block_scale(a, scale_row0, k);
      scales[half][1] = block_scale(a, scale_row1, k);
    }
    cp_async_wait<kFp8DecodeStages - 2>();
    __syncthreads();  // the stage has landed for every thread; the slot refilled below is no longer read
    if (step + kFp8DecodeStages - 1 < steps) load_stage(step + kFp8DecodeStages - 1);
    cp_async_commit();

    const uint32_t stage = base + static_cast<uint32_t>((step % kFp8DecodeStages) * kStageBytes);
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // 64 channels: this lane's 16 feed four MMAs
      const int chunk = half * 4 + c;
      const float scale0 = scales[half][0], scale1 = scales[half][1];
      const uint4 codes0 = load_shared16(stage + weight_offset(r0, chunk));
      const uint4 codes1 = load_shared16(stage + weight_offset(r1, chunk));
      uint32_t w0[8], w1[8];
      e4m3x4_to_bf16(codes0.x, scale0, w0[0], w0[1]);
      e4m3x4_to_bf16(codes0.y, scale0, w0[2], w0[3]);
      e4m3x4_to_bf16(codes0.z, scale0, w0[4], w0[5]);
      e4m3x4_to_bf16(codes0.w, scale0, w0[6], w0[7]);
      e4m3x4_to_bf16(codes1.x, scale1, w1[0], w1[1]);
      e4m3x4_to_bf16(codes1.y, scale1, w1[2], w1[3]);
      e4m3x4_to_bf16(codes1.z, scale1, w1[4], w1[5]);
      e4m3x4_to_bf16(codes1.w, scale1, w1[6], w1[7]);
#pragma unroll
      for (int t = 0; t < kTokenTiles; ++t) {
        const int token = t * 8 + group_lane;
        const uint32_t tokens = stage + kWeightTileBytes;
        const uint4 xa = load_shared16(tokens + token_offset(token, 2 * chunk));
        const uint4 xb = load_shared16(tokens + token_offset(token, 2 * chunk + 1));
        const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t frag[4] = {w0[2 * j], w1[2 * j], w0[2 * j + 1], w1[2 * j + 1]};
          mma::mma_bf16(acc[t], frag, xv[2 * j], xv[2 * j + 1]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // C fragment: acc[t][0..1] = (row r0, tokens 8t + 2c, +1), acc[t][2..3] = (row r1, same tokens).
#pragma unroll
  for (int t = 0; t < kTokenTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int o = m0 + (e < 2 ? r0 : r1), token = t * 8 + 2 * c + (e & 1);
      if (o >= a.out || token >= a.rows) continue;
      const int64_t i = (static_cast<int64_t>(token) * a.groups + g) * a.out + o;
      if (a.splits > 1) {
        a.partial[static_cast<int64_t>(split) * a.rows * a.groups * a.out + i] = acc[t][e];
      } else if (a.y_dtype == DType::bf16) {
        static_cast<uint16_t*>(a.y)[i] = float_to_bf16_bits(acc[t][e]);
      } else {
        static_cast<float*>(a.y)[i] = acc[t][e];
      }
    }
  }
}

template <int kTokenTiles>
void launch_linear_fp8_decode(const Fp8DecodeLaunch& a, cudaStream_t stream) {
  constexpr int shared = fp8_decode_shared_bytes(kTokenTiles);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(linear_fp8_decode_kernel<kTokenTiles>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  const dim3 grid(static_cast<unsigned>((a.out + kFp8DecodeBlockRows - 1) / kFp8DecodeBlockRows),
                  static_cast<unsigned>(a.groups), static_cast<unsigned>(a.splits));
  linear_fp8_decode_kernel<kTokenTiles><<<grid, kFp8DecodeThreads, shared, stream>>>(a);
}

}  // namespace dsv4::cuda
