// Hopper warpgroup MMAs (wgmma, sm_90a): shared-memory matrix descriptors of the 128- and
// 32-byte-swizzled layouts, the fences, the bf16 -> f32 shapes the sparse attention uses
// (S = Q·Kᵀ with Q's first k steps in registers, O += P·V from shared memory) and the e4m3 one of the index scores
// (keys in registers times the queries).
//
// Accumulator layout (PTX "wgmma .m64nNk16 D"): warp w of the warpgroup holds rows 16w … 16w+15;
// lane l, g = l / 4, c = l % 4 holds d[j][0..1] = (16w + g, 8j + 2c … +1), d[j][2..3] = (16w + g + 8, 8j
// + 2c … +1): per warp the mma.sync m16n8 C fragments of mma_fragments.cuh, N / 8 of them. The A
// register fragment of a k step is the mma.sync m16n8k16 A fragment of the warp's 16 rows.
//
// The 128-byte-swizzled layout ("SW128") of a [rows x 512] bf16 tile used here: eight column blocks of
// 64 channels, each [rows][128 B]; within a block, the 16-byte unit u of row r sits at unit u ^ (r % 8).
// Blocks are 1024-byte aligned (the swizzle is applied to address bits). K-major reads (Q·Kᵀ: rows are
// M or N, channels K) advance 32 bytes per k step of 16 inside a block; MN-major reads (P·V: rows are
// K, channels N) take N = 256 as four blocks LBO apart and K = 16 as two 8-row groups SBO apart.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace dsv4::cuda::wgmma {

inline constexpr int kBlockChannels = 64;  // bf16 channels of one 128-byte swizzle row

// Byte offset of channels channel … channel + 7 (channel a multiple of 8) of row `row` in an SW128
// tile of `rows` rows.
__host__ __device__ constexpr uint32_t sw128_offset(int rows, int row, int channel) {
  return static_cast<uint32_t>((channel / kBlockChannels) * rows * 128 + row * 128 +
                               ((((channel / 8) % 8) ^ (row % 8)) * 16));
}

// A shared-memory matrix descriptor of the SW128 layout: start address, leading and stride byte
// offsets (bytes; the descriptor keeps them in 16-byte units), swizzle mode 1 (128 B) in bits 62-63.
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t address, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((address & 0x3FFFFu) >> 4) | static_cast<uint64_t>(leading_bytes >> 4) << 16 |
         static_cast<uint64_t>(stride_bytes >> 4) << 32 | uint64_t{1} << 62;
}
// K-major: 8-row groups 1024 bytes apart; the leading offset is unused with a swizzle (1 by convention).
__device__ __forceinline__ uint64_t k_major(uint32_t address) { return sw128_descriptor(address, 16, 1024); }
// MN-major over a tile of `rows` rows: 64-channel blocks rows·128 bytes apart, 8-row groups 1024.
__device__ __forceinline__ uint64_t mn_major(uint32_t address, int rows) {
  return sw128_descriptor(address, static_cast<uint32_t>(rows) * 128, 1024);
}

// The 32-byte-swizzled K-major layout ("SW32") of a [rows x 32] 8-bit tile (one K = 32 step of an
// e4m3 MMA): row r at 32·r, its 16-byte unit u at unit u ^ ((r / 4) % 2); 256-byte aligned.
__host__ __device__ constexpr uint32_t sw32_offset(int row, int unit) {
  return static_cast<uint32_t>(row * 32 + ((unit ^ ((row / 4) % 2)) * 16));
}
// Its descriptor: 8-row groups 256 bytes apart, swizzle mode 3 (32 B).
__device__ __forceinline__ uint64_t sw32_k_major(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFFu) >> 4) | uint64_t{1} << 16 | uint64_t{256 >> 4} << 32 |
         uint64_t{3} << 62;
}

// Orders the warpgroup's earlier register writes (accumulators, A fragments) before the MMAs that follow.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to the async proxy the MMAs
// read through: each writing thread, before the barrier that hands the data over.
__device__ __forceinline__ void fence_shared_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Keeps the compiler from moving accesses of x across the point (the MMAs write their registers
// asynchronously: reads after wait() must stay after it, A fragments must live until then).
template <class T, int kRows, int kCols>
__device__ __forceinline__ void pin(T (&x)[kRows][kCols]) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint32_t>);
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      if constexpr (std::is_same_v<T, float>) asm volatile("" : "+f"(x[i][j])::"memory");
      else asm volatile("" : "+r"(x[i][j])::"memory");
    }
}

// The accumulator operands of a 64 x N f32 tile d[N / 8][4] (read and written): DSV4_WGMMA_D32(d, j)
// lists n tiles j … j + 3 (32 columns), DSV4_WGMMA_D256(d) all 32 n tiles of N = 256.
#define DSV4_WGMMA_D8(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define DSV4_WGMMA_D32(d, j) DSV4_WGMMA_D8(d, j), DSV4_WGMMA_D8(d, j + 1), DSV4_WGMMA_D8(d, j + 2), DSV4_WGMMA_D8(d, j + 3)
#define DSV4_WGMMA_D256(d)                                                                                   \
  DSV4_WGMMA_D32(d, 0), DSV4_WGMMA_D32(d, 4), DSV4_WGMMA_D32(d, 8), DSV4_WGMMA_D32(d, 12), DSV4_WGMMA_D32(d, 16), \
      DSV4_WGMMA_D32(d, 20), DSV4_WGMMA_D32(d, 24), DSV4_WGMMA_D32(d, 28)

// d (64 x 32, f32) = a·bᵀ + (accumulate ? d : 0), b 32 x 16 bf16 K-major in shared memory; a 64 x 16
// bf16 either in registers (the A fragment) or K-major in shared memory.
__device__ __forceinline__ void m64n32k16_rs(float (&d)[4][4], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : DSV4_WGMMA_D32(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
}
__device__ __forceinline__ void m64n32k16_ss(float (&d)[4][4], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : DSV4_WGMMA_D32(d, 0)
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
}

// d (64 x 256, f32) += a·b: a 64 x 16 bf16 K-major and b 16 x 256 bf16 MN-major, both in shared memory.
__device__ __forceinline__ void m64n256k16_ss(float (&d)[32][4], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : DSV4_WGMMA_D256(d)
      : "l"(a), "l"(b));
}

#undef DSV4_WGMMA_D256
#undef DSV4_WGMMA_D32
#undef DSV4_WGMMA_D8

// d (64 x 32, f32) = a·bᵀ (fresh: the accumulators' previous values are ignored): a 64 x 32 e4m3
// in registers (per warp the mma.sync m16n8k32 A fragment of its 16 rows: a[0] (g, 4c … 4c+3),
// a[1] (g+8, 4c …), a[2] (g, 16+4c …), a[3] (g+8, 16+4c …)), b 32 x 32 e4m3 K-major SW32.
__device__ __forceinline__ void m64n32k32_e4m3_rs(float (&d)[4][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]),
        "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]),
        "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]),
        "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

}  // namespace dsv4::cuda::wgmma
