// The attention stack of a model as a serving engine uses it: sequences are added, stepped with
// any mix of prefill chunks and decode tokens, forked from a shared prefix and released. Layers
// run in order inside a step; consumer layers read their kv source's compressed cache and their
// index source's picks published earlier in the same step (SPEC §1.3).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/kv_format.h"
#include "dsv4/tensor.h"
#include "dsv4/weights.h"

namespace dsv4 {

class Communicator;  // dsv4/parallel.h

enum class Backend : uint8_t { cpu, cuda };
const char* backend_name(Backend b);
Backend parse_backend(const std::string& name);

// fp32: float32 everywhere, no fake quantization (what the transformers V4.0 goldens need).
// reference: bf16 rounding where DeepSeek's official code rounds, FP8/FP4 fake quantization of
// window rows, compressed rows and indexer q/k (SPEC §8).
enum class Precision : uint8_t { fp32, reference };
const char* precision_name(Precision p);
Precision parse_precision(const std::string& name);

struct EngineOptions {
  Backend backend = Backend::cpu;
  Precision precision = Precision::reference;
  // A kv_format_set name: paged caches in those byte formats, allocated up front for
  // max_sequences x max_context tokens. Empty: float storage of the values, growing with each
  // sequence (the sizes below are then only limits).
  std::string kv_format = "";
  int64_t max_sequences = 256;
  int64_t max_tokens_per_step = 8192;
  int64_t max_context = 1 << 16;     // sizes the cache pools: max_sequences x max_context tokens
  int num_threads = 0;               // CPU backend; 0: all cores

  // One rank of a tensor-parallel group (dsv4/parallel.h, docs/parallel.md): the config and weights
  // given to create are the rank's shard (shard_config, shard_weights). The partial output of the
  // rank's heads is computed in fp32, summed over the ranks with `communicator` and then rounded as
  // the whole output is. nullptr (the default): the engine runs the whole model.
  std::shared_ptr<Communicator> communicator;
  // With a communicator and IndexerSharding::split: the whole model's index_n_heads (the index
  // weight scale counts them all); the shard's indexer scores its own heads and the partial scores
  // are summed over the ranks before top-k. 0: every rank runs the whole indexer.
  int split_index_heads = 0;
};

using SequenceId = int64_t;

struct StepEntry {
  SequenceId sequence;
  int64_t num_tokens;                // >= 1; appended at the sequence's current length
};

class Engine {
 public:
  static std::unique_ptr<Engine> create(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                                        const EngineOptions& options);
  virtual ~Engine() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const ModelTopology& topology() const = 0;

  virtual SequenceId add_sequence() = 0;
  // A new sequence that starts with `parent`'s whole current state (prefix sharing).
  virtual SequenceId fork_sequence(SequenceId parent) = 0;
  virtual void release_sequence(SequenceId sequence) = 0;
  virtual int64_t sequence_length(SequenceId sequence) const = 0;

  // Starts a step over the given sequences. Positions of a sequence's tokens continue from its
  // length. All cache space is reserved here: if a pool is exhausted, this throws and nothing changes.
  virtual void begin_step(const std::vector<StepEntry>& entries) = 0;
  // Runs layer `layer` of the step. hidden_in / attn_out: [step_tokens, hidden_size] f32 on the
  // engine's device, tokens of the entries concatenated in order (they may be the same memory).
  // Each layer runs once per step, after its kv source, index source and candidate source.
  virtual void run_layer(int layer, const TensorView& hidden_in, const TensorView& attn_out) = 0;
  // The picks (compressed positions, sorted, -1 padded) an index-source layer published in this
  // step: [step_tokens, index_topk] i32 on the host. Empty before that layer ran; kept until the
  // next begin_step. Throws for a layer that is not an index source.
  virtual HostTensor layer_picks(int layer) const = 0;
  // Commits the step: sequence lengths advance. Every backbone layer must have run; MTP layers
  // are optional, but a sequence whose step skipped one cannot run that layer any more.
  virtual void end_step() = 0;

  // Bytes of cache currently held by a sequence (all layers, all caches).
  virtual int64_t sequence_cache_bytes(SequenceId sequence) const = 0;
};

}  // namespace dsv4
