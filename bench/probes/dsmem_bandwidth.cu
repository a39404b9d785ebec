// Probe: how fast a thread-block cluster moves a block's share of 112 KB of partials between its
// blocks through distributed shared memory, the wgmma attention's split merge (bench/RESULTS.md,
// eighteenth session). Clusters of 2 (64 of them: a decode step of 64 tokens) and of 10 (one: batch
// 1); pulled by `ld.shared::cluster` (remote slices only, or the block's own too, read through its
// cluster address or locally), or pushed by bulk copies (`cp.async.bulk.shared::cluster`) that
// complete on the receiver's mbarrier. Prints the median over 20 launches of each block's time.
// Not part of the build (an sm_90a probe, not a benchmark of the library):
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -o dsmem_bandwidth dsmem_bandwidth.cu
#include <cooperative_groups.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
namespace cg = cooperative_groups;
constexpr int kThreads = 256;
constexpr int kData = 112 * 1024;  // a block's partial (bytes)
__device__ __forceinline__ uint64_t now() { uint64_t t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint32_t mapa(uint32_t a, uint32_t r) { uint32_t o; asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(r)); return o; }
__device__ __forceinline__ float4 ldc(uint32_t a) { float4 v; asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory"); return v; }

__device__ __forceinline__ float4 lds(uint32_t a) { float4 v; asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory"); return v; }
template <int kInFlight, int kOwn = 0>
__global__ void pull(uint64_t* times, float* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int S = cluster.num_blocks(), r = cluster.block_rank();
  for (int i = threadIdx.x; i < kData / 4; i += kThreads) reinterpret_cast<float*>(smem)[i] = i * 0.5f + r;
  cluster.sync();
  const uint64_t t0 = now();
  const int slice = kData / S / 16 * 16, first = r * slice;  // bytes of slice r, from every block
  float acc = 0;
  const uint32_t base = smem_addr(smem);
  for (int off = threadIdx.x * 16; off < slice; off += kThreads * 16 * kInFlight) {
    float4 v[kInFlight][1];
    for (int z = 0; z < S; ++z) {
      if (kOwn == 0 && z == r) continue;
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        const int o = off + i * kThreads * 16;
        if (o < slice) v[i][0] = kOwn == 2 && z == r ? lds(base + first + o) : ldc(mapa(base + first + o, z)); else v[i][0] = make_float4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) acc += v[i][0].x + v[i][0].y + v[i][0].z + v[i][0].w;
    }
  }
  __syncthreads();
  const uint64_t t1 = now();
  if (threadIdx.x == 0) times[blockIdx.x] = t1 - t0;
  if (acc == 12345.f) sink[0] = acc;
  cluster.sync();
}

// Each block pushes slice z of its data into block z's receive area (at r·slice) with bulk copies.
__global__ void push(uint64_t* times, float* sink, int chunk) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bar;
  cg::cluster_group cluster = cg::this_cluster();
  const int S = cluster.num_blocks(), r = cluster.block_rank();
  uint8_t* recv = smem + kData;
  const int slice = kData / S / 16 * 16;
  for (int i = threadIdx.x; i < kData / 4; i += kThreads) reinterpret_cast<float*>(smem)[i] = i * 0.5f + r;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bar)));
    asm volatile("fence.mbarrier_init.release.cluster;");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(&bar)), "r"((S - 1) * slice));
  }
  asm volatile("fence.proxy.async.shared::cta;");
  cluster.sync();
  const uint64_t t0 = now();
  if (threadIdx.x < S && threadIdx.x != r) {
    const int z = threadIdx.x;
    const uint32_t dst = mapa(smem_addr(recv + r * slice), z), mb = mapa(smem_addr(&bar), z);
    for (int o = 0; o < slice; o += chunk) {
      const int n = min(chunk, slice - o);
      asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(dst + o), "r"(smem_addr(smem + z * slice + o)), "r"(n), "r"(mb) : "memory");
    }
  }
  // wait for the incoming bytes
  if (threadIdx.x == 0) {
    uint32_t done = 0;
    while (!done) asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(smem_addr(&bar)));
  }
  __syncthreads();
  float acc = 0;
  for (int i = threadIdx.x; i < (S - 1) * slice / 4; i += kThreads) acc += reinterpret_cast<float*>(recv)[i];
  __syncthreads();
  const uint64_t t1 = now();
  if (threadIdx.x == 0) times[blockIdx.x] = t1 - t0;
  if (acc == 12345.f) sink[0] = acc;
  cluster.sync();  // no block exits while copies into it may be pending / its smem is read
}

template <class K>
void run(const char* name, K kernel, int blocks, int S, int chunk) {
  uint64_t* times; float* sink;
  cudaMalloc(&times, blocks * 8); cudaMalloc(&sink, 4);
  const int smem = 2 * kData;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaLaunchConfig_t c = {}; c.gridDim = dim3(blocks); c.blockDim = dim3(kThreads); c.dynamicSmemBytes = smem;
  cudaLaunchAttribute a = {}; a.id = cudaLaunchAttributeClusterDimension; a.val.clusterDim.x = S; a.val.clusterDim.y = a.val.clusterDim.z = 1;
  c.attrs = &a; c.numAttrs = 1;
  std::vector<double> med;
  for (int rep = 0; rep < 20; ++rep) {
    cudaError_t e = chunk ? cudaLaunchKernelEx(&c, (void(*)(uint64_t*, float*, int))kernel, times, sink, chunk)
                          : cudaLaunchKernelEx(&c, (void(*)(uint64_t*, float*))kernel, times, sink);
    if (e != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) { printf("%s: error %s\n", name, cudaGetErrorString(cudaGetLastError())); return; }
    std::vector<uint64_t> t(blocks); cudaMemcpy(t.data(), times, blocks * 8, cudaMemcpyDeviceToHost);
    std::sort(t.begin(), t.end()); med.push_back(double(t[blocks / 2]));
  }
  std::sort(med.begin(), med.end());
  const double ns = med[med.size() / 2], bytes = double(kData / S / 16 * 16) * (S - 1);
  printf("%-28s S=%2d blocks=%3d: %.0f ns for %.0f KB remote per block -> %.1f GB/s per SM\n", name, S, blocks, ns, bytes / 1024, bytes / ns);
}

int main() {
  for (int S : {2, 10}) {
    const int blocks = S == 2 ? 128 : 10;
    run("pull remote x4", pull<4, 0>, blocks, S, 0);
    run("pull remote x8", pull<8, 0>, blocks, S, 0);
    run("pull + own via mapa x8", pull<8, 1>, blocks, S, 0);
    run("pull + own via ld.shared x8", pull<8, 2>, blocks, S, 0);
    run("push bulk chunks of 4K", push, blocks, S, 4096);
    run("push bulk chunks of 16K", push, blocks, S, 16384);
    run("push bulk whole", push, blocks, S, 1 << 20);
  }
}
