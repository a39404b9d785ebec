// The attention stack of a model as a serving engine uses it: sequences are added, stepped with
// any mix of prefill chunks and decode tokens, forked from a shared prefix and released. Layers
// run in order inside a step; consumer layers read their kv source's compressed cache and their
// index source's picks published earlier in the same step (SPEC §1.3).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/kv_format.h"
#include "dsv4/tensor.h"
#include "dsv4/types.h"
#include "dsv4/weights.h"

namespace dsv4 {

class Communicator;  // dsv4/parallel.h

// Where the caches keep their rows.
enum class CacheStorage : uint8_t {
  // Pages in the byte formats of `kv_format`, allocated up front for max_sequences x max_context
  // tokens. Every backend.
  paged,
  // The rows' float values, growing with each sequence (max_sequences and max_context are then
  // only limits): exact in every precision, for checking numerics. The cpu backend only.
  float_rows,
};

struct EngineOptions {
  Backend backend = Backend::cpu;
  Precision precision = Precision::reference;
  CacheStorage cache_storage = CacheStorage::paged;
  // With paged storage: a kv_format_set name, or empty for default_kv_formats(config, precision)
  // (the formats whose decoded rows are the precision's values, the same on every backend).
  std::string kv_format = "";
  int64_t max_sequences = 256;
  int64_t max_tokens_per_step = 8192;
  int64_t max_context = 1 << 16;     // sizes the cache pools: max_sequences x max_context tokens
  // Speculative decoding: the most tokens rollback_sequence may take back (the drafts of one verify
  // step). The caches then keep that many window rows and compressor rows beyond what sequential
  // decoding needs, so that a rollback is exact. 0: no rollback.
  int64_t max_rollback = 0;
  int num_threads = 0;               // cpu backend; 0: all cores
  // cuda backend: the stream every operation and every host<->device copy of the engine is queued
  // on (a cudaStream_t; the caller keeps it alive while the engine exists). nullptr: the engine
  // creates a stream of its own (Engine::cuda_stream()).
  CUstream_st* cuda_stream = nullptr;
  // cuda backend on Hopper (sm_90), reference precision: device memory for a prefill step's
  // attended cache pages decoded to bf16. A step whose tokens attend each cached row many times
  // (prefill chunks) then decodes every page of a layer's window and kv source once and attends
  // the bf16 rows, instead of decoding each row once per token that attends it; the outputs are the
  // same bits. A layer whose pages need more than this attends the quantized rows directly, as do
  // decode steps. The engine holds at most what one layer's pools can stage. 0: never stage.
  int64_t attention_stage_bytes = int64_t{512} << 20;

  // One rank of a tensor-parallel group (dsv4/parallel.h, docs/parallel.md): the config and weights
  // given to create are the rank's shard (make_rank_shard). The partial output of the rank's heads
  // is computed in fp32, summed over the ranks with `communicator` and then rounded as the whole
  // output is. nullptr (the default): the engine runs the whole model.
  std::shared_ptr<Communicator> communicator;
  // With a communicator: whether the shard's indexer holds every index head or the rank's share.
  IndexerSharding indexer_sharding = IndexerSharding::replicated;

  // The layers the engine runs (the weights need only those): every layer, or only the DSpark draft
  // layers, a drafter beside the target model's engine (LayerSet::draft; load its weights with
  // load_weights(..., LayerSet::draft)). A drafter's steps run no backbone layer.
  LayerSet layers = LayerSet::all;
};

// Memory an engine holds on its backend's device (host memory for the cpu backend).
struct EngineMemory {
  int64_t weights = 0;    // converted layer weights
  int64_t caches = 0;     // cache pools or rows, compressor states
  int64_t workspace = 0;  // step metadata, intermediate rows, scratch
  int64_t total() const { return weights + caches + workspace; }
};

class Engine {
 public:
  // Checks the options against the config and the weights (throwing "dsv4: engine: create: ...")
  // and builds the backend's engine.
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
  // Takes back the sequence's tokens from position `new_length` on (the drafts a verify step did
  // not accept): afterwards its caches and compressor state are exactly what a run over its first
  // new_length tokens leaves, and its next step continues at new_length. Speculative decoding:
  // a verify step carries the bonus token and K drafts of a sequence (K + 1 tokens, equal to K + 1
  // single-token steps); with k drafts accepted, rollback_sequence(s, length_before + 1 + k).
  // new_length must lie in [longest - max_rollback, length], `longest` being the longest length
  // the sequence (or the parent it was forked from) has had; not during a step.
  virtual void rollback_sequence(SequenceId sequence, int64_t new_length) = 0;

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

  // ----- DSpark draft layers (config().has_dspark(); SPEC §13.1, docs/speculative.md)
  //
  // The draft layers keep a window of rows per sequence like every layer, but the rows of committed
  // tokens come from the target model, and queries come in draft blocks that are never committed:
  //   begin_step(...); run_layer(...) for the backbone; run_draft_context(main_hidden); end_step();
  //   run_draft_block(stage 0 layer, sequences, ...); [the caller's draft block]; ... next stage ...
  //
  // Inside a step, in place of run_layer for the draft layers: main_hidden [step_tokens,
  // hidden_size · |dspark_target_layer_ids|] f32 on the engine's device holds, per token, the
  // hidden states entering the target layers (each the mean over the hc copies of the residual
  // stream), concatenated in dspark_target_layer_ids order. The engine computes main_x =
  // main_norm(main_proj(main_hidden)) once, and every draft layer stores its window row of each
  // token from it (its own wkv, kv_norm, RoPE, row quantization). A step that leaves this out
  // cannot draft for its sequences afterwards (as for a skipped MTP layer).
  virtual void run_draft_context(const TensorView& main_hidden) = 0;
  // Outside a step: draft layer `layer` over one block of dspark_block_size = B rows per sequence,
  // the block of `sequences[i]` at rows i·B … i·B + B − 1 of hidden_in / attn_out ([sequences · B,
  // hidden_size] f32 on the engine's device, may be the same memory; sequences · B <=
  // max_tokens_per_step). With p0 = sequence_length − 1 (>= 0) the last committed token, block
  // row j sits at position p0 + 1 + j (below max_context) and attends the window rows of
  // positions max(0, p0 − W + 1) … p0 and all B rows of its block, itself and the later ones
  // included (non-causal). The block's keys are not stored: caches and lengths are unchanged, and
  // a block may be run again.
  virtual void run_draft_block(int layer, const std::vector<SequenceId>& sequences, const TensorView& hidden_in,
                               const TensorView& attn_out) = 0;

  // Bytes of cache currently held by a sequence (all layers, all caches).
  virtual int64_t sequence_cache_bytes(SequenceId sequence) const = 0;

  // What the engine holds; allocated at create and constant afterwards except for float_rows
  // caches, which grow.
  virtual EngineMemory memory() const = 0;
  // cuda backend: the stream the engine queues its work on (EngineOptions::cuda_stream or its own).
  // Wait for it (or order work after it) before reading attn_out or caches. nullptr on the cpu.
  virtual CUstream_st* cuda_stream() const = 0;
  // cuda backend, after begin_step: the step's graph key. Steps with equal keys launch the same
  // kernels with the same arguments: their per-step data (tokens, block tables, slots) sits at
  // device addresses fixed at create and only its contents change. So the run_layer calls of one
  // step, captured into a CUDA graph on cuda_stream() (with device activations), replay any later
  // step of the same key given the same activation buffers (docs/cuda.md). The key covers the
  // step's token count, each kv source's entries rounded up to 1/8 of their power of two, and image
  // spans' window bounds. 0 on the cpu backend.
  virtual uint64_t step_graph_key() const = 0;
  // Inside a step, before any of its layers ran: runs `enqueue` — the step's run_layer calls (and
  // run_draft_context), with whatever the caller queues between them on cuda_stream() — as the
  // CUDA graph of step_graph_key(). The first step of a key captures `enqueue` into a graph and
  // launches it; later steps of the key only launch that graph (`enqueue` is not called) and
  // count the layers it ran as run. The caller's buffers must be the same for every step of a key.
  // Returns whether a graph was replayed. The cpu backend calls `enqueue` (returns false).
  virtual bool run_step_graph(const std::function<void()>& enqueue) = 0;
};

}  // namespace dsv4
