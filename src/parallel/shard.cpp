// Tensor-parallel shards of a model: the rank's config and the rank's slices of the weights
// (dsv4/parallel.h, docs/parallel.md).
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/error.h"
#include "dsv4/parallel.h"

namespace dsv4 {
namespace {

void check_rank(const char* operation, int rank, int tp) {
  DSV4_CHECK(tp >= 1, "tensor parallel: ", operation, ": tp is ", tp, ", expected >= 1");
  DSV4_CHECK(rank >= 0 && rank < tp, "tensor parallel: ", operation, ": rank is ", rank, ", expected 0 ... ", tp - 1);
}

// The memory of a sliced tensor: its values and, for fp8, its block scales.
struct SliceStorage {
  std::vector<std::byte> data, scales;
};

// Whether a layer has any tensor (MTP layers may be left out of a checkpoint as a whole).
bool has_any_weight(const LayerWeights& w) {
  for (const auto& t : w.tensors)
    if (t.has_value()) return true;
  return false;
}

// Copies `element`-byte values from a [rows, cols] array into `to`, keeping rows (columns = false)
// or columns [first, first + count).
void copy_slice(const void* from, int64_t rows, int64_t cols, size_t element, bool columns, int64_t first,
                int64_t count, std::vector<std::byte>& to) {
  const auto* src = static_cast<const std::byte*>(from);
  const int64_t out_rows = columns ? rows : count, out_cols = columns ? count : cols;
  to.resize(static_cast<size_t>(out_rows * out_cols) * element);
  for (int64_t r = 0; r < out_rows; ++r) {
    const int64_t src_row = columns ? r : first + r, src_col = columns ? first : 0;
    std::memcpy(to.data() + static_cast<size_t>(r * out_cols) * element,
                src + static_cast<size_t>(src_row * cols + src_col) * element, static_cast<size_t>(out_cols) * element);
  }
}

// Elements [first, first + count) of dimension `dim` (0: rows, 1: columns) of a 1-D or 2-D tensor
// whose shape was checked, copied. fp8 block scales are sliced with it, so the slice must fall on
// scale-block boundaries.
WeightTensor slice(const WeightTensor& w, int layer, WeightRole role, int dim, int64_t first, int64_t count) {
  const auto where = [&] { return "tensor parallel: shard_weights: layer " + std::to_string(layer) + " weight '" +
                                  weight_role_name(role) + "'"; };
  DSV4_CHECK(w.data != nullptr, where(), " has no data");
  auto storage = std::make_shared<SliceStorage>();
  WeightTensor s = w;
  s.shape[static_cast<size_t>(dim)] = count;
  const bool vector = w.shape.size() == 1;  // one row whose columns are sliced
  copy_slice(w.data, vector ? 1 : w.shape[0], w.shape.back(), dtype_size(w.dtype), vector || dim == 1, first, count,
             storage->data);
  s.data = storage->data.data();
  if (w.is_fp8()) {
    const int64_t rows = w.shape[0], cols = w.shape[1];
    const std::vector<int64_t> scale_shape{w.block_out > 0 ? (rows + w.block_out - 1) / w.block_out : 0,
                                           w.block_in > 0 ? (cols + w.block_in - 1) / w.block_in : 0};
    DSV4_CHECK(w.block_out > 0 && w.block_in > 0 && w.scale_data != nullptr && w.scale_shape == scale_shape, where(),
               " is fp8 with scales of shape ", shape_string(w.scale_shape), " for blocks of ", w.block_out, " x ",
               w.block_in, ", expected ", shape_string(scale_shape));
    const int64_t block = dim == 0 ? w.block_out : w.block_in, extent = w.shape[static_cast<size_t>(dim)];
    DSV4_CHECK(first % block == 0 && (count % block == 0 || first + count == extent), where(), " is fp8 with ", block,
               dim == 0 ? "-row" : "-column", " scale blocks; the rank's ", dim == 0 ? "rows " : "columns ", first,
               " ... ", first + count - 1, " do not start and end on block boundaries (use bf16 weights, or a tp "
               "that gives every rank whole blocks)");
    const int64_t blocks = (count + block - 1) / block;
    copy_slice(w.scale_data, scale_shape[0], scale_shape[1], dtype_size(w.scale_dtype), dim == 1, first / block,
               blocks, storage->scales);
    s.scale_shape[static_cast<size_t>(dim)] = blocks;
    s.scale_data = storage->scales.data();
  }
  s.owner = storage;
  return s;
}

}  // namespace

const char* indexer_sharding_name(IndexerSharding s) {
  return s == IndexerSharding::replicated ? "replicated" : "split";
}

IndexerSharding parse_indexer_sharding(const std::string& name) {
  if (name == "replicated") return IndexerSharding::replicated;
  if (name == "split") return IndexerSharding::split;
  fail("tensor parallel: unknown indexer sharding '", name, "', expected replicated or split");
}

ModelConfig shard_config(const ModelConfig& config, int rank, int tp, IndexerSharding indexer) {
  check_rank("shard_config", rank, tp);
  ModelConfig whole = config;
  whole.tensor_parallel_size = tp;
  validate_config(whole);  // heads and output groups divisible by tp
  if (indexer == IndexerSharding::split)
    DSV4_CHECK(config.index_n_heads % tp == 0, "tensor parallel: shard_config: field 'index_n_heads' = ",
               config.index_n_heads, " must be divisible by tensor_parallel_size = ", tp,
               " to split the indexer (or keep it replicated)");
  ModelConfig shard = config;
  shard.num_heads = config.num_heads / tp;
  shard.o_groups = config.o_groups / tp;
  if (indexer == IndexerSharding::split) shard.index_n_heads = config.index_n_heads / tp;
  shard.tensor_parallel_size = 1;
  validate_config(shard);
  return shard;
}

ModelWeights shard_weights(const ModelWeights& weights, const ModelConfig& config, int rank, int tp,
                           IndexerSharding indexer) {
  check_rank("shard_weights", rank, tp);
  const ModelConfig shard = shard_config(config, rank, tp, indexer);
  const ModelTopology topology = resolve_topology(config);
  DSV4_CHECK(static_cast<int>(weights.layers.size()) == config.total_layers(), "tensor parallel: shard_weights: the "
             "weights have ", weights.layers.size(), " layers, the config ", config.total_layers());
  const int64_t D = config.head_dim, R = config.o_lora_rank, dI = config.index_head_dim;
  ModelWeights out;
  out.owners = weights.owners;
  for (int l = 0; l < config.total_layers(); ++l) {
    const LayerWeights& whole = weights.layers[static_cast<size_t>(l)];
    LayerWeights& part = out.layers.emplace_back(whole);
    // MTP layers may be absent from a checkpoint as a whole; they stay absent.
    if (topology[l].is_mtp && !has_any_weight(whole)) continue;
    // Checked against the whole model so that a slice never reads beyond a tensor.
    for (const ExpectedWeight& e : expected_layer_weights(config, topology[l])) {
      const WeightTensor& w = whole.get(e.role);
      DSV4_CHECK(w.shape == e.shape, "tensor parallel: shard_weights: layer ", l, " weight '", weight_role_name(e.role),
                 "' has shape ", shape_string(w.shape), ", expected ", shape_string(e.shape));
    }
    const auto cut = [&](WeightRole role, int dim, int64_t per_rank) {
      part.tensors[static_cast<size_t>(role)] = slice(whole.get(role), l, role, dim, rank * per_rank, per_rank);
    };
    cut(WeightRole::wq_b, 0, shard.num_heads * D);
    cut(WeightRole::attn_sink, 0, shard.num_heads);
    cut(WeightRole::wo_a, 0, shard.o_groups * R);
    cut(WeightRole::wo_b, 1, shard.o_groups * R);
    if (indexer == IndexerSharding::split && topology[l].owns_indexer) {
      cut(WeightRole::indexer_wq_b, 0, shard.index_n_heads * dI);
      cut(WeightRole::indexer_weights_proj, 0, shard.index_n_heads);
    }
  }
  return out;
}

RankShard make_rank_shard(const ModelConfig& config, const ModelWeights& weights, EngineOptions options,
                          std::shared_ptr<Communicator> communicator, IndexerSharding indexer) {
  DSV4_CHECK(communicator != nullptr, "tensor parallel: make_rank_shard: no communicator given");
  const int rank = communicator->rank(), tp = communicator->size();
  RankShard shard;
  shard.config = shard_config(config, rank, tp, indexer);
  shard.weights = std::make_shared<const ModelWeights>(shard_weights(weights, config, rank, tp, indexer));
  options.communicator = std::move(communicator);
  options.indexer_sharding = indexer;
  shard.options = std::move(options);
  return shard;
}

}  // namespace dsv4
