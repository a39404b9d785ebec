// The vocabulary every part of dsv4 speaks: backends, precisions, sequences and step entries.
// Small on purpose: the CPU reference, the caches and the bindings include it without the engine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

// The CUDA runtime's stream handle (cudaStream_t is CUstream_st*), declared here so that public
// headers can take a caller's stream without including cuda_runtime.h.
struct CUstream_st;

namespace dsv4 {

enum class Backend : uint8_t { cpu, cuda };
const char* backend_name(Backend b);
Backend parse_backend(const std::string& name);

// fp32: float32 everywhere, no fake quantization (what the transformers V4.0 goldens need).
// reference: bf16 rounding where DeepSeek's official code rounds, FP8/FP4 fake quantization of
// window rows, compressed rows and indexer q/k (SPEC §8).
enum class Precision : uint8_t { fp32, reference };
const char* precision_name(Precision p);
Precision parse_precision(const std::string& name);

// How the indexer of an index-source layer is spread over tensor-parallel ranks (dsv4/parallel.h).
enum class IndexerSharding : uint8_t {
  replicated,  // every rank computes every index head (no communication, redundant work)
  split,       // each rank scores index_n_heads / tp heads; partial scores are all-reduced
};

using SequenceId = int64_t;

// An image span of a prefill chunk (SPEC §14): absolute positions first … last (inclusive) whose
// tokens see each other in the sliding window in both directions.
struct ImageSpan {
  int64_t first = 0;
  int64_t last = 0;
};

struct StepEntry {
  SequenceId sequence;
  int64_t num_tokens;  // >= 1; appended at the sequence's current length
  // Optional, empty by default (plain causal attention): the entry's image spans, each inside the
  // entry's tokens, disjoint, at most ModelConfig::vision_max_n_token long (docs/reference.md, "Image spans").
  std::vector<ImageSpan> image_spans = {};
};

}  // namespace dsv4
