#include "cuda/ops/attention/split_kv.h"

#include "cuda/common/device_math.cuh"
#include "cuda/ops/attention/split_merge.cuh"

namespace dsv4::cuda {
namespace {

// One block per (token, head), one thread per 4 channels.
template <class Out>
__global__ void split_kv_combine_kernel(SplitKvCombine c) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t stride = c.tokens * c.heads;
  auto index = [&](int z) { return z * stride + t * c.heads + h; };
  const SplitNormalization n = normalize_splits(
      c.splits, [&](int z) { return c.partials.stats[index(z)]; }, c.sink ? c.sink[h] * kLog2e : -INFINITY);
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (n.any())
    for (int z = 0; z < c.splits; ++z) {
      const float weight = n.weight(c.partials.stats[index(z)].x);  // 0 for a split that attended nothing
      const float4 v = reinterpret_cast<const float4*>(c.partials.out + index(z) * c.head_dim)[threadIdx.x];
      sum.x += v.x * weight, sum.y += v.y * weight, sum.z += v.z * weight, sum.w += v.w * weight;
    }
  if (c.lse && threadIdx.x == 0) c.lse[t * c.heads + h] = n.lse();
  const float v[4] = {sum.x * n.inverse, sum.y * n.inverse, sum.z * n.inverse, sum.w * n.inverse};
  store4(static_cast<Out*>(c.out) + (t * c.heads + h) * c.head_dim + threadIdx.x * 4, v);
}

// A cluster plan's cost: its tiles per block times the waves its clusters take, capacity[splits] of
// them at once.
int64_t cluster_plan_tiles(int64_t blocks, const SplitKvPlan& plan, std::span<const int> capacity) {
  const size_t splits = static_cast<size_t>(plan.splits);
  const int64_t at_once = splits < capacity.size() ? std::max(capacity[splits], 1) : 1;
  return (blocks + at_once - 1) / at_once * plan.tiles_per_split;
}

size_t partial_out_bytes(int64_t tokens, int64_t heads, int64_t head_dim, int splits) {
  return align_workspace(static_cast<size_t>(splits) * static_cast<size_t>(tokens * heads * head_dim) * sizeof(float));
}

}  // namespace

SplitKvPlan plan_split_kv(int64_t blocks, int64_t tiles, bool split_allowed) {
  tiles = std::max<int64_t>(1, tiles);
  blocks = std::max<int64_t>(1, blocks);
  const int64_t splits = split_allowed ? std::clamp<int64_t>((kSplitKvTargetBlocks + blocks - 1) / blocks, 1,
                                                             std::min<int64_t>(tiles, 65535))
                                       : 1;
  return {static_cast<int>(splits), (tiles + splits - 1) / splits};
}

SplitKvPlan plan_split_kv_one_wave(int64_t blocks, int64_t tiles, bool split_allowed) {
  tiles = std::max<int64_t>(1, tiles);
  blocks = std::max<int64_t>(1, blocks);
  const int64_t splits = split_allowed ? std::clamp<int64_t>(kOneWaveBlocks / blocks, 1, std::min<int64_t>(tiles, 65535)) : 1;
  return {static_cast<int>(splits), (tiles + splits - 1) / splits};
}

SplitKvPlan plan_split_kv_clusters(int64_t blocks, int64_t tiles, std::span<const int> capacity) {
  tiles = std::max<int64_t>(1, tiles);
  blocks = std::max<int64_t>(1, blocks);
  SplitKvPlan best{1, tiles};
  int64_t best_cost = INT64_MAX;
  for (int64_t splits = 1; splits < static_cast<int64_t>(capacity.size()) && splits <= tiles; ++splits) {
    const int64_t per_split = (tiles + splits - 1) / splits;
    // Only the fewest splits of each tile count per block (more would leave a block without rows),
    // and only in one wave of clusters: a second, partial one costs a whole block's time.
    if (capacity[splits] <= 0 || (tiles + per_split - 1) / per_split != splits ||
        (splits > 1 && blocks > capacity[splits]))
      continue;
    const SplitKvPlan plan{static_cast<int>(splits), per_split};
    if (const int64_t cost = cluster_plan_tiles(blocks, plan, capacity); cost < best_cost) best = plan, best_cost = cost;
  }
  return best;
}

ClusterSplitPlan plan_split_kv_clusters(int64_t tokens, int64_t heads, int max_heads_per_block, int64_t tiles,
                                        std::span<const int> capacity) {
  tokens = std::max<int64_t>(1, tokens);
  heads = std::max<int64_t>(1, heads);
  ClusterSplitPlan best{};
  double best_cost = 0.0;
  for (int width = max_heads_per_block; width >= 16; width /= 2) {
    if (width != max_heads_per_block && width >= heads) continue;  // the same blocks as a wider group
    const int64_t blocks = tokens * ((heads + width - 1) / width);
    const SplitKvPlan split = plan_split_kv_clusters(blocks, tiles, capacity);
    const double merge = split.splits > 1 ? kMergeTilesPer64Heads * (split.splits - 1) / split.splits *
                                                static_cast<double>(std::min<int64_t>(width, heads)) / 64.0
                                          : 0.0;
    const double cost = static_cast<double>(cluster_plan_tiles(blocks, split, capacity)) + merge;
    if (best.heads_per_block == 0 || cost < best_cost) best = {split, width}, best_cost = cost;
  }
  return best;
}

size_t split_kv_workspace_bytes(int64_t tokens, int64_t heads, int64_t head_dim, int splits) {
  if (splits <= 1) return 0;
  return partial_out_bytes(tokens, heads, head_dim, splits) +
         align_workspace(static_cast<size_t>(splits * tokens * heads) * sizeof(float2));
}

SplitKvPartials split_kv_partials(void* workspace, int64_t tokens, int64_t heads, int64_t head_dim, int splits) {
  if (splits <= 1) return {};
  return {static_cast<float*>(workspace),
          reinterpret_cast<float2*>(static_cast<std::byte*>(workspace) + partial_out_bytes(tokens, heads, head_dim, splits))};
}

void run_split_kv_combine(const SplitKvCombine& c, cudaStream_t stream) {
  if (c.tokens == 0 || c.heads == 0) return;
  const dim3 grid(static_cast<unsigned>(c.tokens), static_cast<unsigned>(c.heads));
  const unsigned threads = static_cast<unsigned>(c.head_dim / 4);
  if (c.out_dtype == DType::bf16) split_kv_combine_kernel<uint16_t><<<grid, threads, 0, stream>>>(c);
  else split_kv_combine_kernel<float><<<grid, threads, 0, stream>>>(c);
  check_launch("split_kv_combine");
}

}  // namespace dsv4::cuda
