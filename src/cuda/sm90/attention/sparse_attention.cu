// Validation and dispatch of run_sparse_attention; the kernels are instantiated in
// src/cuda/instantiations/sparse_attention_*.cu.
#include "cuda/sm90/attention/sparse_attention.cuh"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "cuda/common/check_args.h"
#include "dsv4/cuda/attention.h"

namespace dsv4::cuda {

extern template void launch_sparse_attention<512, uint16_t>(const SparseAttentionLaunch&, cudaStream_t);
extern template void launch_sparse_attention<512, float>(const SparseAttentionLaunch&, cudaStream_t);

namespace {

constexpr int64_t kHeadDim = 512;  // the head size the kernels are built for (every V4 / V4.1 model)

// Blocks a step should have before splitting rows pays off (two per SM of an H100 / H200); a
// constant, so that the workspace size does not depend on the device.
constexpr int64_t kTargetBlocks = 264;

struct Split {
  int splits;
  int64_t tiles_per_split;
};

// max_rows: the most rows a token can attend (window + picks per token). More rows never mean
// fewer splits, which sparse_attention_max_workspace_bytes relies on.
Split row_split(int64_t tokens, int64_t heads, int64_t max_rows, bool allowed) {
  const int64_t tiles = std::max<int64_t>(1, (max_rows + kAttentionTileRows - 1) / kAttentionTileRows);
  const int64_t blocks = std::max<int64_t>(1, tokens * ((heads + kAttentionHeadsPerBlock - 1) / kAttentionHeadsPerBlock));
  const int64_t splits = allowed ? std::clamp<int64_t>((kTargetBlocks + blocks - 1) / blocks, 1, std::min<int64_t>(tiles, 65535)) : 1;
  return {static_cast<int>(splits), (tiles + splits - 1) / splits};
}

Split row_split(const SparseAttentionParams& p, bool allowed) {
  const int64_t max_rows = p.window_size + (is_present(p.compressed.pages) ? p.picks.shape[1] : 0);
  return row_split(p.q.shape[0], p.q.shape[1], max_rows, allowed);
}

// The split path's workspace: partial P·V [splits, tokens, heads, 512] f32, then the partial
// (max, sum) [splits, tokens, heads] float2.
size_t partial_out_bytes(int64_t tokens, int64_t heads, int splits) {
  return align_workspace(static_cast<size_t>(splits) * static_cast<size_t>(tokens * heads * kHeadDim) * sizeof(float));
}

size_t split_workspace_bytes(int64_t tokens, int64_t heads, int splits) {
  if (splits <= 1) return 0;
  return partial_out_bytes(tokens, heads, splits) +
         align_workspace(static_cast<size_t>(splits * tokens * heads) * sizeof(float2));
}

void launch(const SparseAttentionParams& p, void* workspace, cudaStream_t stream) {
  SparseAttentionLaunch a;
  a.tokens = p.q.shape[0];
  a.heads = static_cast<int>(p.q.shape[1]);
  if (a.tokens == 0 || a.heads == 0) return;
  a.q = p.q.ptr<const uint16_t>();
  a.token_sequence = p.token_sequence.ptr<const int32_t>();
  a.token_position = p.token_position.ptr<const int32_t>();
  a.window = device_rows(p.window);
  a.window_size = p.window_size;
  if (is_present(p.compressed.pages)) {
    a.compressed = device_rows(p.compressed);
    a.picks = p.picks.ptr<const int32_t>();
    a.num_picks = p.picks.shape[1];
    a.compress_ratio = p.compress_ratio;
  }
  a.sink = p.sink.ptr<const float>();
  a.scale = p.scale;
  a.out = p.out.data;
  const Split split = row_split(p, workspace != nullptr);
  a.splits = split.splits;
  a.tiles_per_split = split.tiles_per_split;
  if (a.splits > 1) {
    a.partial_out = static_cast<float*>(workspace);
    a.partial_stats =
        reinterpret_cast<float2*>(static_cast<std::byte*>(workspace) + partial_out_bytes(a.tokens, a.heads, a.splits));
  }
  if (p.out.dtype == DType::bf16) launch_sparse_attention<512, uint16_t>(a, stream);
  else launch_sparse_attention<512, float>(a, stream);
  check_launch("sparse_attention");
}

const std::vector<KvRowFormat> kAttentionFormats = {KvRowFormat::bf16, KvRowFormat::fp8_per_tensor,
                                                    KvRowFormat::v41_fp8, KvRowFormat::v41_fp4,
                                                    KvRowFormat::fp8_ds_mla};

}  // namespace

void validate_sparse_attention(const SparseAttentionParams& p) {
  constexpr const char* op = "sparse_attention";
  const bool has_compressed = is_present(p.compressed.pages);
  const int64_t tokens = p.q.shape[0], heads = p.q.shape[1];
  std::vector<TensorSpec> specs = {
      {"q", &p.q, {kAnyDim, kAnyDim, kHeadDim}, {DType::bf16}},
      {"token_sequence", &p.token_sequence, {tokens}, {DType::i32}},
      {"token_position", &p.token_position, {tokens}, {DType::i32}},
  };
  for (TensorSpec& s : paged_cache_specs("window", p.window, true, kAnyDim)) specs.push_back(std::move(s));
  if (has_compressed) {
    for (TensorSpec& s : paged_cache_specs("compressed", p.compressed, true, kAnyDim)) specs.push_back(std::move(s));
    specs.push_back({"picks", &p.picks, {tokens, kAnyDim}, {DType::i32}});
  }
  specs.push_back({"sink", &p.sink, {heads}, {DType::f32}});
  specs.push_back({"out", &p.out, {tokens, heads, kHeadDim}, {DType::bf16, DType::f32}});
  check_tensors(op, specs);

  DSV4_CHECK(has_compressed || !is_present(p.picks), op,
             ": argument 'picks' is given without a 'compressed' cache to read them from");
  check_paged_cache(op, "window", p.window, kHeadDim, kAttentionFormats);
  if (has_compressed) check_paged_cache(op, "compressed", p.compressed, kHeadDim, kAttentionFormats);
  DSV4_CHECK(p.window_size >= 1, op, ": window_size is ", p.window_size, ", expected >= 1");
  DSV4_CHECK(p.compress_ratio >= 0, op, ": compress_ratio is ", p.compress_ratio, ", expected >= 0");
  DSV4_CHECK(std::isfinite(p.scale), op, ": scale is ", p.scale, ", expected a finite number");
  for (const auto& [name, view] : {std::pair{"q", &p.q}, std::pair{"out", &p.out}})
    DSV4_CHECK(reinterpret_cast<uintptr_t>(view->data) % 16 == 0, op, ": argument '", name,
               "' is not 16-byte aligned");
}

size_t sparse_attention_workspace_bytes(const SparseAttentionParams& p) {
  validate_sparse_attention(p);
  return split_workspace_bytes(p.q.shape[0], p.q.shape[1], row_split(p, true).splits);
}

size_t sparse_attention_max_workspace_bytes(int64_t max_tokens, int64_t heads, int64_t max_rows) {
  DSV4_CHECK(max_tokens >= 0 && heads >= 0 && max_rows >= 0, "sparse_attention: max_workspace_bytes: max_tokens ",
             max_tokens, ", heads ", heads, ", max_rows ", max_rows, ", expected >= 0 each");
  // Steps of kTargetBlocks tokens or more never split.
  size_t most = 0;
  for (int64_t tokens = 1; tokens <= std::min(max_tokens, kTargetBlocks); ++tokens)
    most = std::max(most, split_workspace_bytes(tokens, heads, row_split(tokens, heads, max_rows, true).splits));
  return most;
}

void run_sparse_attention(const SparseAttentionParams& p, void* workspace, cudaStream_t stream) {
  validate_sparse_attention(p);
  if (row_split(p, true).splits > 1) check_workspace("sparse_attention", workspace);
  launch(p, workspace, stream);
}

void run_sparse_attention(const SparseAttentionParams& p, cudaStream_t stream) {
  validate_sparse_attention(p);
  launch(p, nullptr, stream);
}

}  // namespace dsv4::cuda
