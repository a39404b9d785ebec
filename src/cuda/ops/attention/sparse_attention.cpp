// run_sparse_attention: validation, then the chooser picks an implementation
// (sparse_attention_implementations.h).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/common/check_args.h"
#include "cuda/common/paged_rows.h"
#include "cuda/ops/attention/sparse_attention_implementations.h"
#include "dsv4/cuda/attention.h"
#include "dsv4/kv_format.h"

namespace dsv4::cuda {

namespace {

constexpr int64_t kHeadDim = 512;  // the head size of every V4 / V4.1 model

// Implementations in order of preference (sparse_attention_implementations.h); the SIMT fallback last.
constexpr const SparseAttentionImplementation* kImplementations[] = {&kSparseAttentionWgmma, &kSparseAttentionDecodeMma,
                                                                     &kSparseAttentionMmaBf16, &kSparseAttentionSimt};

const std::vector<KvRowFormat> kAttentionFormats = {KvRowFormat::bf16,    KvRowFormat::fp8_per_tensor,
                                                    KvRowFormat::v41_fp8, KvRowFormat::v41_fp4,
                                                    KvRowFormat::fp8_ds_mla, KvRowFormat::f32};

std::string gathered_cache_supported(const char* name, const PagedCache& cache, std::span<const KvRowFormat> formats,
                                    const char* unsupported, int alignment) {
  const KvRowFormat f = cache.geometry.format;
  if (std::find(formats.begin(), formats.end(), f) == formats.end())
    return std::string("cache '") + name + "' has format " + kv_row_format_name(f) + ", " + unsupported;
  const PageGeometry& g = cache.geometry;
  const int64_t n = alignment;
  if (reinterpret_cast<uintptr_t>(cache.pages.data) % n != 0 || g.page_stride % n != 0 || g.data_offset(1) % n != 0 ||
      g.scale_offset(0) % n != 0 || (g.scale_offset(1) - g.scale_offset(0)) % n != 0)
    return std::string("cache '") + name + "' has rows that are not " + std::to_string(alignment) + "-byte aligned";
  return "";
}

}  // namespace

std::string gathered_caches_supported(const SparseAttentionParams& p, std::span<const KvRowFormat> formats,
                                      const char* unsupported, int alignment) {
  if (is_present(p.window.pages))
    if (std::string why_not = gathered_cache_supported("window", p.window, formats, unsupported, alignment);
        !why_not.empty())
      return why_not;
  if (is_present(p.compressed.pages))
    return gathered_cache_supported("compressed", p.compressed, formats, unsupported, alignment);
  return "";
}

void validate_sparse_attention(const SparseAttentionParams& p) {
  constexpr const char* op = "sparse_attention";
  const bool has_compressed = is_present(p.compressed.pages);
  const int64_t tokens = p.q.shape[0], heads = p.q.shape[1];
  std::vector<TensorSpec> specs = {
      {"q", &p.q, {kAnyDim, kAnyDim, kHeadDim}, {DType::bf16, DType::f32}},
      {"token_sequence", &p.token_sequence, {tokens}, {DType::i32}, !is_present(p.window.block_table) &&
                                                                         !is_present(p.compressed.block_table)},
      {"token_position", &p.token_position, {tokens}, {DType::i32}, p.window_size == 0 && p.compress_ratio == 0},
      {"window_first", &p.window_first, {tokens}, {DType::i32}, true},
      {"window_last", &p.window_last, {tokens}, {DType::i32}, true},
  };
  // window_size 0 attends no window rows (the picks alone): the window cache may then be absent.
  const bool has_window = p.window_size != 0 || is_present(p.window.pages);
  if (has_window)
    for (TensorSpec& s : paged_cache_specs("window", p.window, true, kAnyDim)) specs.push_back(std::move(s));
  if (has_compressed) {
    for (TensorSpec& s : paged_cache_specs("compressed", p.compressed, true, kAnyDim)) specs.push_back(std::move(s));
    specs.push_back({"picks", &p.picks, {tokens, kAnyDim}, {DType::i32}});
    specs.push_back({"pick_count", &p.pick_count, {tokens}, {DType::i32}, true});
  }
  specs.push_back({"sink", &p.sink, {heads}, {DType::f32}, true});
  specs.push_back({"out", &p.out, {tokens, heads, kHeadDim}, {DType::bf16, DType::f32}});
  specs.push_back({"lse", &p.lse, {tokens, heads}, {DType::f32}, true});
  check_tensors(op, specs);

  DSV4_CHECK(has_compressed || (!is_present(p.picks) && !is_present(p.pick_count)), op,
             ": argument 'picks' or 'pick_count' is given without a 'compressed' cache to read them from");
  if (has_window) check_paged_cache(op, "window", p.window, kHeadDim, kAttentionFormats);
  if (has_compressed) check_paged_cache(op, "compressed", p.compressed, kHeadDim, kAttentionFormats);
  DSV4_CHECK(p.window_size >= 0, op, ": window_size is ", p.window_size, ", expected >= 0");
  const bool widened = is_present(p.window_first);
  DSV4_CHECK(!widened || is_present(p.window_last), op,
             ": argument 'window_last' is absent; window_first needs window_last");
  DSV4_CHECK(!(widened || is_present(p.window_last)) || has_window, op,
             ": window_first / window_last are given without a 'window' cache");
  DSV4_CHECK(!widened || p.max_window_rows >= 1, op, ": max_window_rows is ", p.max_window_rows,
             ", expected >= 1 with window_first");
  DSV4_CHECK(p.compress_ratio >= 0, op, ": compress_ratio is ", p.compress_ratio, ", expected >= 0");
  DSV4_CHECK(std::isfinite(p.scale), op, ": scale is ", p.scale, ", expected a finite number");
  for (const auto& [name, view] : {std::pair{"q", &p.q}, std::pair{"out", &p.out}})
    DSV4_CHECK(reinterpret_cast<uintptr_t>(view->data) % 16 == 0, op, ": argument '", name,
               "' is not 16-byte aligned");
}

int64_t max_attended_rows(const SparseAttentionParams& p) {
  const int64_t window = is_present(p.window_first) ? p.max_window_rows : p.window_size;
  return window + (is_present(p.compressed.pages) ? p.picks.shape[1] : 0);
}

SplitKvPlan SparseAttentionImplementation::plan(int64_t tokens, int64_t heads, int64_t max_rows,
                                                bool split_allowed) const {
  const int64_t blocks = tokens * ((heads + blocking.heads_per_block - 1) / blocking.heads_per_block);
  const int64_t tiles = (max_rows + blocking.tile_rows - 1) / blocking.tile_rows;
  return blocking.one_block_per_sm ? plan_split_kv_one_wave(blocks, tiles, split_allowed)
                                   : plan_split_kv(blocks, tiles, split_allowed);
}

SplitKvPlan SparseAttentionImplementation::plan(const SparseAttentionParams& p, bool split_allowed) const {
  return plan(p.q.shape[0], p.q.shape[1], max_attended_rows(p), split_allowed);
}

// A merges_in_cluster implementation uses none of the workspace but splits only when given one
// (run's contract), so a step it may split asks for kClusterSplitWorkspaceBytes: a caller that
// allocates workspace_bytes(p) and passes it then lets it split. Whether the step may split is the
// device-free one-wave plan's answer (plan), which the launch's cluster plan follows on an H100 /
// H200 (plan_split_kv_clusters: fewer blocks than clusters of two fill one wave).
size_t SparseAttentionImplementation::workspace_bytes(const SparseAttentionParams& p) const {
  const int splits = plan(p, true).splits;
  if (blocking.merges_in_cluster) return p.q.shape[0] > 0 && splits > 1 ? kClusterSplitWorkspaceBytes : 0;
  return split_kv_workspace_bytes(p.q.shape[0], p.q.shape[1], blocking.head_dim, splits);
}

size_t SparseAttentionImplementation::max_workspace_bytes(int64_t max_tokens, int64_t heads, int64_t max_rows) const {
  auto splits_of = [&](int64_t tokens) { return plan(tokens, heads, max_rows, true).splits; };
  // One token is the step most split.
  if (blocking.merges_in_cluster) return max_tokens > 0 && splits_of(1) > 1 ? kClusterSplitWorkspaceBytes : 0;
  return split_kv_max_workspace_bytes(max_tokens, heads, blocking.head_dim, splits_of);
}

std::span<const SparseAttentionImplementation* const> sparse_attention_implementations() { return kImplementations; }

const SparseAttentionImplementation& choose_sparse_attention(const SparseAttentionParams& p, const DeviceInfo& device) {
  return choose_implementation("sparse_attention", sparse_attention_implementations(), p, device);
}

const char* sparse_attention_implementation(const SparseAttentionParams& p) {
  validate_sparse_attention(p);
  return choose_sparse_attention(p, device_info()).name;
}

// The workspace covers whichever implementation the device picks, so its size needs no device.
size_t sparse_attention_workspace_bytes(const SparseAttentionParams& p) {
  validate_sparse_attention(p);
  size_t most = 0;
  for (const SparseAttentionImplementation* implementation : sparse_attention_implementations())
    most = std::max(most, implementation->workspace_bytes(p));
  return most;
}

size_t sparse_attention_max_workspace_bytes(int64_t max_tokens, int64_t heads, int64_t max_rows) {
  DSV4_CHECK(max_tokens >= 0 && heads >= 0 && max_rows >= 0, "sparse_attention: max_workspace_bytes: max_tokens ",
             max_tokens, ", heads ", heads, ", max_rows ", max_rows, ", expected >= 0 each");
  size_t most = 0;
  for (const SparseAttentionImplementation* implementation : sparse_attention_implementations())
    most = std::max(most, implementation->max_workspace_bytes(max_tokens, heads, max_rows));
  return most;
}

void run_sparse_attention(const SparseAttentionParams& p, void* workspace, cudaStream_t stream) {
  validate_sparse_attention(p);
  const SparseAttentionImplementation& implementation = choose_sparse_attention(p, device_info());
  if (implementation.workspace_bytes(p) > 0) check_workspace("sparse_attention", workspace);
  implementation.run(p, workspace, stream);
}

void run_sparse_attention(const SparseAttentionParams& p, cudaStream_t stream) {
  validate_sparse_attention(p);
  choose_sparse_attention(p, device_info()).run(p, nullptr, stream);
}

}  // namespace dsv4::cuda
