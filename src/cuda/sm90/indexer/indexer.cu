// Indexer ops: validation and dispatch of the score kernel (instantiated in
// src/cuda/instantiations/index_scores_*.cu), the candidate block scores and the top-k selection.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/common/check_args.h"
#include "cuda/sm90/indexer/index_scores.cuh"
#include "dsv4/cuda/indexer.h"

namespace dsv4::cuda {

extern template void launch_index_scores<128>(const IndexScoresLaunch&, cudaStream_t);

namespace {

constexpr int64_t kIndexDim = 128;     // the index head size the score kernel is built for
constexpr int kMaxIndexHeads = 128;    // keeps the queries of a token in shared memory
constexpr int kTopkThreads = 256;
constexpr int kBlockScoreThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// Entries visible to a query at `position` (SPEC §4.4).
__device__ __forceinline__ int64_t visible_entries(int64_t position, int ratio) {
  return position >= 0 ? (position + 1) / ratio : 0;
}

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

// Order-preserving key of a score for "larger is better": 0 for -inf (not eligible), 1 for NaN
// (eligible, below every number), and for numbers an unsigned code >= 2 ordered like the floats
// (-0 and +0 equal).
__device__ __forceinline__ uint32_t topk_key(float score) {
  if (score != score) return 1u;
  if (score == -INFINITY) return 0u;
  const uint32_t bits = float_bits(score == 0.0f ? 0.0f : score);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct TopkLaunch {
  const float* scores = nullptr;
  int64_t n = 0;
  const int32_t* token_position = nullptr;  // null: the whole row is eligible
  int compress_ratio = 0;
  int64_t group_size = 1;
  int32_t* picks = nullptr;
  int64_t k = 0;
};

// One block per row: a 4-pass radix select finds the key of the k-th best element, then one
// ordered pass writes every better element and the first ties in index order (so the picks come
// out ascending).
__global__ void __launch_bounds__(kTopkThreads) topk_kernel(TopkLaunch a) {
  using Scan = cub::BlockScan<int, kTopkThreads>;
  using Reduce = cub::BlockReduce<int, kTopkThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ unsigned histogram[256];
  __shared__ uint32_t shared_prefix;
  __shared__ int shared_remaining;
  __shared__ int shared_eligible;

  const int64_t t = blockIdx.x;
  const float* row = a.scores + t * a.n;
  int32_t* picks = a.picks + t * a.k;
  int64_t length = a.n;
  if (a.token_position && a.compress_ratio > 0) {
    const int64_t visible = visible_entries(a.token_position[t], a.compress_ratio);
    length = min(length, (visible + a.group_size - 1) / a.group_size);
  }

  int eligible = 0;
  for (int64_t j = threadIdx.x; j < length; j += kTopkThreads) eligible += topk_key(row[j]) != 0u;
  eligible = Reduce(temp.reduce).Sum(eligible);
  if (threadIdx.x == 0) shared_eligible = eligible;
  __syncthreads();
  const int64_t take = a.k < shared_eligible ? a.k : int64_t{shared_eligible};

  // Select keys > threshold, plus the first `ties` keys == threshold in index order.
  uint32_t threshold = 0u;
  int64_t ties = 0;
  if (take < shared_eligible) {
    uint32_t prefix = 0u, mask = 0u;
    int remaining = static_cast<int>(take);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < 256; i += kTopkThreads) histogram[i] = 0u;
      __syncthreads();
      for (int64_t j = threadIdx.x; j < length; j += kTopkThreads) {
        const uint32_t key = topk_key(row[j]);
        if (key != 0u && (key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int above = 0, bucket = 255;
        for (; bucket > 0 && above + static_cast<int>(histogram[bucket]) < remaining; --bucket) above += histogram[bucket];
        shared_prefix = prefix | (static_cast<uint32_t>(bucket) << shift);
        shared_remaining = remaining - above;
      }
      __syncthreads();
      prefix = shared_prefix;
      remaining = shared_remaining;
      mask |= 0xffu << shift;
    }
    threshold = prefix;
    ties = remaining;
  }

  int64_t written = 0, ties_seen = 0;
  for (int64_t base = 0; base < length && written < take; base += kTopkThreads) {
    const int64_t j = base + threadIdx.x;
    const uint32_t key = j < length ? topk_key(row[j]) : 0u;
    const int is_tie = ties > 0 && key == threshold;
    int tie_rank = 0, tie_total = 0;
    Scan(temp.scan).ExclusiveSum(is_tie, tie_rank, tie_total);
    __syncthreads();
    const int selected = key > threshold || (is_tie && ties_seen + tie_rank < ties);
    int slot = 0, selected_total = 0;
    Scan(temp.scan).ExclusiveSum(selected, slot, selected_total);
    __syncthreads();
    if (selected) picks[written + slot] = static_cast<int32_t>(j);
    written += selected_total;
    ties_seen += tie_total;
  }
  for (int64_t i = take + threadIdx.x; i < a.k; i += kTopkThreads) picks[i] = -1;
}

std::vector<int64_t> optional_tokens_shape(const TensorView& v, int64_t tokens) {
  return is_present(v) ? std::vector<int64_t>{tokens} : std::vector<int64_t>{kAnyDim};
}

}  // namespace

void validate_index_scores(const IndexScoresParams& p) {
  constexpr const char* op = "index_scores";
  const int64_t tokens = p.q.shape[0], heads = p.q.shape[1];
  std::vector<TensorSpec> specs = {
      {"q", &p.q, {kAnyDim, kAnyDim, kIndexDim}, {DType::bf16}},
      {"weights", &p.weights, {tokens, heads}, {DType::f32}},
  };
  for (TensorSpec& s : paged_cache_specs("keys", p.keys, true, kAnyDim)) specs.push_back(std::move(s));
  specs.push_back({"token_sequence", &p.token_sequence, {tokens}, {DType::i32}});
  specs.push_back({"token_position", &p.token_position, {tokens}, {DType::i32}});
  specs.push_back({"candidates", &p.candidates, {tokens, kAnyDim}, {DType::i32}, true});
  specs.push_back({"scores", &p.scores, {tokens, kAnyDim}, {DType::f32}});
  check_tensors(op, specs);
  check_paged_cache(op, "keys", p.keys, kIndexDim,
                    {KvRowFormat::index_mxfp4, KvRowFormat::index_fp8, KvRowFormat::bf16});
  DSV4_CHECK(heads <= kMaxIndexHeads, op, ": ", heads, " index heads, at most ", kMaxIndexHeads, " are supported");
  DSV4_CHECK(p.compress_ratio >= 1, op, ": compress_ratio is ", p.compress_ratio, ", expected >= 1");
  DSV4_CHECK(!is_present(p.candidates) || p.candidate_block_size >= 1, op, ": candidate_block_size is ",
             p.candidate_block_size, ", expected >= 1 with candidates");
  DSV4_CHECK(p.scores.shape[1] <= kMaxGridY * kIndexEntriesPerBlock, op, ": ", p.scores.shape[1],
             " entries per row, at most ", kMaxGridY * kIndexEntriesPerBlock, " are supported");
}

void run_index_scores(const IndexScoresParams& p, cudaStream_t stream) {
  validate_index_scores(p);
  IndexScoresLaunch a;
  a.tokens = p.q.shape[0];
  a.heads = static_cast<int>(p.q.shape[1]);
  a.entries = p.scores.shape[1];
  if (a.tokens == 0 || a.entries == 0) return;
  a.q = p.q.ptr<const uint16_t>();
  a.weights = p.weights.ptr<const float>();
  a.keys = device_rows(p.keys);
  a.token_sequence = p.token_sequence.ptr<const int32_t>();
  a.token_position = p.token_position.ptr<const int32_t>();
  a.compress_ratio = p.compress_ratio;
  if (is_present(p.candidates)) {
    a.candidates = p.candidates.ptr<const int32_t>();
    a.num_candidates = p.candidates.shape[1];
    a.candidate_block_size = p.candidate_block_size;
  }
  a.scores = p.scores.ptr<float>();
  launch_index_scores<kIndexDim>(a, stream);
  check_launch("index_scores");
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

void run_topk(const TopkParams& p, cudaStream_t stream) {
  validate_topk(p);
  TopkLaunch a;
  const int64_t tokens = p.scores.shape[0];
  a.n = p.scores.shape[1];
  a.k = p.picks.shape[1];
  if (tokens == 0 || a.k == 0) return;
  a.scores = p.scores.ptr<const float>();
  if (is_present(p.token_position)) a.token_position = p.token_position.ptr<const int32_t>();
  a.compress_ratio = p.compress_ratio;
  a.group_size = p.group_size;
  a.picks = p.picks.ptr<int32_t>();
  topk_kernel<<<static_cast<unsigned>(tokens), kTopkThreads, 0, stream>>>(a);
  check_launch("topk");
}

}  // namespace dsv4::cuda
