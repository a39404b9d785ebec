// Indexer ops: validation and the choosers of index scores and top-k (their implementations:
// indexer_implementations.h), and the candidate block scores (one implementation, here).
#include <algorithm>

#include "cuda/common/check_args.h"
#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.h"
#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/indexer_launch.h"
#include "cuda/ops/indexer/visible_entries.cuh"
#include "dsv4/cuda/indexer.h"

namespace dsv4::cuda {

namespace {

constexpr int kBlockScoreThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// In order of preference (indexer_implementations.h); the SIMT fallbacks last.
constexpr const IndexScoresImplementation* kIndexScoresImplementations[] = {&kIndexScoresWgmma, &kIndexScoresMmaF16,
                                                                                &kIndexScoresSimt};
constexpr const TopkImplementation* kTopkImplementations[] = {&kTopkRadix, &kTopkSimt};

__global__ void candidate_block_scores_kernel(const float* scores, const int32_t* token_position, int ratio,
                                              int64_t block_size, int64_t entries, int64_t blocks, float* out) {
  const int64_t t = blockIdx.x;
  const int64_t b = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  const int64_t visible = min(visible_entries(token_position[t], ratio), entries);
  const float* row = scores + t * entries;
  float best = -INFINITY;
  for (int64_t j = b * block_size; j < min((b + 1) * block_size, visible); ++j)
    if (row[j] > best) best = row[j];  // NaN never compares greater
  if (visible > 0 && b == (visible - 1) / block_size) best = INFINITY;
  out[t * blocks + b] = best;
}

std::vector<int64_t> optional_tokens_shape(const TensorView& v, int64_t tokens) {
  return is_present(v) ? std::vector<int64_t>{tokens} : std::vector<int64_t>{kAnyDim};
}

}  // namespace

std::span<const IndexScoresImplementation* const> index_scores_implementations() { return kIndexScoresImplementations; }
std::span<const TopkImplementation* const> topk_implementations() { return kTopkImplementations; }

std::string tensor_core_copies_supported(const IndexScoresParams& p, int64_t scale_bytes) {
  if (reinterpret_cast<uintptr_t>(p.q.data) % 16 != 0) return "q that is not 16-byte aligned";
  const PageGeometry& g = p.keys.geometry;
  if (reinterpret_cast<uintptr_t>(p.keys.pages.data) % 16 != 0 || g.page_stride % 16 != 0 || g.data_offset(0) % 16 != 0 ||
      g.data_offset(1) % 16 != 0 || g.scale_offset(0) % scale_bytes != 0 || g.scale_offset(1) % scale_bytes != 0)
    return "key rows that are not 16-byte aligned";
  return "";
}

const IndexScoresImplementation& choose_index_scores(const IndexScoresParams& p, const DeviceInfo& device) {
  return choose_implementation("index_scores", index_scores_implementations(), p, device);
}

const TopkImplementation& choose_topk(const TopkParams& p, const DeviceInfo& device) {
  return choose_implementation("topk", topk_implementations(), p, device);
}

void validate_index_scores(const IndexScoresParams& p) {
  constexpr const char* op = "index_scores";
  const int64_t tokens = p.q.shape[0], heads = p.q.shape[1], dim = p.q.shape[2];
  std::vector<TensorSpec> specs = {
      {"q", &p.q, {kAnyDim, kAnyDim, kAnyDim}, {DType::bf16, DType::f32}},
      {"weights", &p.weights, {tokens, heads}, {DType::f32}},
  };
  for (TensorSpec& s : paged_cache_specs("keys", p.keys, true, kAnyDim)) specs.push_back(std::move(s));
  // Flat keys (no block table) are slots: no sequence to look them up by.
  specs.push_back({"token_sequence", &p.token_sequence, {tokens}, {DType::i32}, !is_present(p.keys.block_table)});
  specs.push_back({"token_position", &p.token_position, {tokens}, {DType::i32}});
  specs.push_back({"candidates", &p.candidates, {tokens, kAnyDim}, {DType::i32}, true});
  specs.push_back({"scores", &p.scores, {tokens, kAnyDim}, {DType::f32}});
  check_tensors(op, specs);
  check_paged_cache(op, "keys", p.keys, dim,
                    {KvRowFormat::index_mxfp4, KvRowFormat::index_fp8, KvRowFormat::bf16, KvRowFormat::f32});
  DSV4_CHECK(p.compress_ratio >= 1, op, ": compress_ratio is ", p.compress_ratio, ", expected >= 1");
  DSV4_CHECK(!is_present(p.candidates) || p.candidate_block_size >= 1, op, ": candidate_block_size is ",
             p.candidate_block_size, ", expected >= 1 with candidates");
}

int64_t index_keys_per_cta(int64_t entries, int64_t token_groups, size_t shared_bytes, int max_resident, int64_t granule,
                           int64_t min_keys, int waves, const DeviceInfo& device) {
  const int64_t resident = std::clamp<int64_t>(device.max_shared_bytes_per_sm / static_cast<int64_t>(shared_bytes + 1024),
                                               1, max_resident);
  const int64_t places = std::max(device.multiprocessors, 1) * resident;  // CTAs a wave
  const int64_t most = std::clamp<int64_t>(waves * places / token_groups, 1, std::max<int64_t>(1, entries / min_keys));
  // The fewest splits whose CTAs fill the last of their waves to kFullWave (CTAs of equal work
  // finish together, and longer ranges amortize the query staging and the pipeline's start), else
  // the fullest last wave.
  constexpr double kFullWave = 0.95;
  int64_t splits = 1;
  double fullest = 0.0;
  for (int64_t s = 1; s <= most; ++s) {
    const int64_t ctas = s * token_groups;
    const double fill = static_cast<double>(ctas) / static_cast<double>((ctas + places - 1) / places * places);
    if (fill > fullest) fullest = fill, splits = s;
    if (fill >= kFullWave) break;
  }
  const int64_t keys = (entries + splits - 1) / splits;
  return (keys + granule - 1) / granule * granule;
}

IndexScoresLaunch index_scores_launch(const IndexScoresParams& p) {
  IndexScoresLaunch a;
  a.tokens = p.q.shape[0];
  a.heads = static_cast<int>(p.q.shape[1]);
  a.dim = static_cast<int>(p.q.shape[2]);
  a.entries = p.scores.shape[1];
  if (p.q.dtype == DType::f32) a.q_f32 = p.q.ptr<const float>();
  else a.q = p.q.ptr<const uint16_t>();
  a.weights = p.weights.ptr<const float>();
  a.keys = device_rows(p.keys);
  if (is_present(p.token_sequence)) a.token_sequence = p.token_sequence.ptr<const int32_t>();
  a.token_position = p.token_position.ptr<const int32_t>();
  a.compress_ratio = p.compress_ratio;
  if (is_present(p.candidates)) {
    a.candidates = p.candidates.ptr<const int32_t>();
    a.num_candidates = p.candidates.shape[1];
    a.candidate_block_size = p.candidate_block_size;
  }
  a.scores = p.scores.ptr<float>();
  a.bf16_rounding = p.bf16_rounding;
  a.partial = p.partial;
  return a;
}

void run_index_scores(const IndexScoresParams& p, cudaStream_t stream) {
  validate_index_scores(p);
  choose_index_scores(p, device_info()).run(p, stream);
}

const char* index_scores_implementation(const IndexScoresParams& p) {
  validate_index_scores(p);
  return choose_index_scores(p, device_info()).name;
}

void validate_candidate_block_scores(const CandidateBlockScoresParams& p) {
  constexpr const char* op = "candidate_block_scores";
  DSV4_CHECK(p.block_size >= 1, op, ": block_size is ", p.block_size, ", expected >= 1");
  const int64_t tokens = p.scores.shape[0], entries = p.scores.shape[1];
  check_tensors(op, {
      {"scores", &p.scores, {kAnyDim, kAnyDim}, {DType::f32}},
      {"token_position", &p.token_position, {tokens}, {DType::i32}},
      {"block_scores", &p.block_scores, {tokens, (entries + p.block_size - 1) / p.block_size}, {DType::f32}},
  });
  DSV4_CHECK(p.compress_ratio >= 1, op, ": compress_ratio is ", p.compress_ratio, ", expected >= 1");
}

void run_candidate_block_scores(const CandidateBlockScoresParams& p, cudaStream_t stream) {
  validate_candidate_block_scores(p);
  const int64_t tokens = p.scores.shape[0], entries = p.scores.shape[1], blocks = p.block_scores.shape[1];
  if (tokens == 0 || blocks == 0) return;
  DSV4_CHECK((blocks + kBlockScoreThreads - 1) / kBlockScoreThreads <= kMaxGridY, "candidate_block_scores: ", blocks,
             " blocks per row are too many");
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>((blocks + kBlockScoreThreads - 1) / kBlockScoreThreads));
  candidate_block_scores_kernel<<<grid, kBlockScoreThreads, 0, stream>>>(
      p.scores.ptr<const float>(), p.token_position.ptr<const int32_t>(), p.compress_ratio, p.block_size, entries,
      blocks, p.block_scores.ptr<float>());
  check_launch("candidate_block_scores");
}

void validate_topk(const TopkParams& p) {
  constexpr const char* op = "topk";
  const int64_t tokens = p.scores.shape[0];
  check_tensors(op, {
      {"scores", &p.scores, {kAnyDim, kAnyDim}, {DType::f32}},
      {"token_position", &p.token_position, optional_tokens_shape(p.token_position, tokens), {DType::i32}, true},
      {"picks", &p.picks, {tokens, kAnyDim}, {DType::i32}},
  });
  DSV4_CHECK(p.compress_ratio >= 0, op, ": compress_ratio is ", p.compress_ratio, ", expected >= 0");
  DSV4_CHECK(p.group_size >= 1, op, ": group_size is ", p.group_size, ", expected >= 1");
  DSV4_CHECK(p.scores.shape[1] <= INT32_MAX, op, ": rows of ", p.scores.shape[1], " scores exceed the i32 pick range");
}

TopkLaunch topk_launch(const TopkParams& p) {
  TopkLaunch a;
  a.scores = p.scores.ptr<const float>();
  a.n = p.scores.shape[1];
  if (is_present(p.token_position)) a.token_position = p.token_position.ptr<const int32_t>();
  a.compress_ratio = p.compress_ratio;
  a.group_size = p.group_size;
  a.picks = p.picks.ptr<int32_t>();
  a.k = p.picks.shape[1];
  return a;
}

void run_topk(const TopkParams& p, cudaStream_t stream) {
  validate_topk(p);
  choose_topk(p, device_info()).run(p, stream);
}

const char* topk_implementation(const TopkParams& p) {
  validate_topk(p);
  return choose_topk(p, device_info()).name;
}

}  // namespace dsv4::cuda
