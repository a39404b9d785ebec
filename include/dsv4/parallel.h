// Tensor parallelism (docs/parallel.md): one engine per rank runs a shard of every attention layer
// and the ranks sum their partial results through a Communicator.
//
// Rank r of tp holds query heads r·H/tp … (r+1)·H/tp − 1 with their wq_b rows and attn_sink
// entries, output groups r·G/tp … (r+1)·G/tp − 1 (heads are grouped contiguously) with their
// wo_a rows and wo_b columns. Everything else — wq_a, q_norm, wkv, kv_norm, the compressors and
// every cache — is replicated. The engine's partial wo_b outputs are all-reduced (in fp32, then
// rounded as the whole output would be). The indexer is either replicated (every rank scores every
// index head) or split (each rank scores index heads r·nI/tp …; the head-weighted partial score
// sums are all-reduced before top-k), so that every rank picks the same entries.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/engine.h"
#include "dsv4/weights.h"

namespace dsv4 {

// The collectives of one rank of a tensor-parallel group.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sums `count` floats at `data` over the ranks, in place; every rank ends with the same sums,
  // bit for bit. `data` is memory of the rank's engine device. On a GPU the sum is queued on
  // `stream` (a cudaStream_t) and the call returns without waiting; on the CPU `stream` is nullptr
  // and the sums are there on return.
  virtual void all_reduce_sum(float* data, int64_t count, void* stream) = 0;
};

// IndexerSharding (how the indexer is spread over the ranks) is in dsv4/engine.h.
const char* indexer_sharding_name(IndexerSharding s);
// "replicated" or "split"; throws naming the given value otherwise.
IndexerSharding parse_indexer_sharding(const std::string& name);

// The config a rank's engine runs: num_heads / tp heads, o_groups / tp groups, with
// IndexerSharding::split index_n_heads / tp index heads, tensor_parallel_size 1 (the shard is one
// model on one device). Checks `config` with tensor_parallel_size = tp, 0 <= rank < tp and, when
// split, that tp divides index_n_heads; throws naming the field otherwise.
ModelConfig shard_config(const ModelConfig& config, int rank, int tp, IndexerSharding indexer);

// The weights of rank `rank`'s shard of `weights` (full-model weights of `config`): the rank's rows
// of wq_b (head h: rows h·head_dim …), attn_sink entries, wo_a rows (group g: rows g·o_lora_rank …),
// wo_b columns (group g: columns g·o_lora_rank …) and, when split, indexer wq_b rows (index head i:
// rows i·index_head_dim …) and indexer weights_proj rows. Sliced tensors are copied; replicated
// ones share the original memory (the shard keeps `weights`' owners alive). An fp8 tensor is
// sliced with its block scales, so a slice must start and end on a scale-block boundary (the
// released models' 512-row heads and 1024-wide groups always do); otherwise this throws naming the
// layer, tensor and boundary. MTP layers absent from `weights` stay absent.
ModelWeights shard_weights(const ModelWeights& weights, const ModelConfig& config, int rank, int tp,
                           IndexerSharding indexer);

// What the engine of one rank is created from (Engine::create(shard.config, shard.weights,
// shard.options)): the rank's shard of the model, and `options` with the communicator and the
// indexer sharding set.
struct RankShard {
  ModelConfig config;
  std::shared_ptr<const ModelWeights> weights;
  EngineOptions options;
};
RankShard make_rank_shard(const ModelConfig& config, const ModelWeights& weights, EngineOptions options,
                          std::shared_ptr<Communicator> communicator, IndexerSharding indexer);

// Whether this build can make NCCL communicators (CUDA with NCCL found at configure time).
bool nccl_available();

// The NCCL communicator of rank `rank` of `size` ranks, one process each, on CUDA device `device`
// (made current for the calling thread). The ranks find each other through `id_file`: rank 0
// writes the group's NCCL unique id there (the file must not exist yet), the other ranks wait up
// to `timeout_s` seconds for it. Throws when NCCL is not available or the group cannot form.
std::shared_ptr<Communicator> make_nccl_communicator(const std::string& id_file, int rank, int size, int device,
                                                     double timeout_s = 120.0);
// Every rank of a group inside one process, rank r on devices[r]: each rank's engine then runs on a
// thread of its own with the rank's device current, and that thread releases the rank's
// communicator (destroying one waits for the other ranks to do the same).
std::vector<std::shared_ptr<Communicator>> make_local_nccl_group(const std::vector<int>& devices);

}  // namespace dsv4
