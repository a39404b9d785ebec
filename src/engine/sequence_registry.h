// The live sequences of an engine, whatever its backend: ids, the limit on how many live at once,
// and per sequence the optional (MTP) layers one of its steps skipped, whose caches of that
// sequence are therefore incomplete, and the longest length it has had (how far back a rollback
// may reach).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "dsv4/engine.h"

namespace dsv4 {

class SequenceRegistry {
 public:
  SequenceRegistry(size_t num_layers, int64_t max_sequences)
      : num_layers_(num_layers), max_sequences_(max_sequences) {}

  // A new id, after checking that another sequence may live; `create(id)` builds its caches and
  // may throw, in which case nothing is registered. A fork starts with its parent's skipped layers.
  SequenceId add(const std::function<void(SequenceId)>& create);
  SequenceId fork(SequenceId parent, const std::function<void(SequenceId)>& create);
  void remove(SequenceId sequence);

  // The layers `sequence` skipped; throws "dsv4: engine: <operation>: sequence N does not exist".
  std::vector<uint8_t>& skipped_layers(const char* operation, SequenceId sequence);
  const std::vector<uint8_t>& skipped_layers(const char* operation, SequenceId sequence) const;
  // The longest length the sequence has had (a fork starts with its parent's), raised by `length`.
  int64_t longest_length(const char* operation, SequenceId sequence) const;
  void note_length(SequenceId sequence, int64_t length);

  // Checks a step's entries before anything is reserved: at least one, each a live sequence at
  // most once with at least one token, together within options.max_tokens_per_step, each sequence
  // within options.max_context. length(s): the sequence's committed length.
  void check_step(const std::vector<StepEntry>& entries, const EngineOptions& options,
                  const std::function<int64_t(SequenceId)>& length) const;

 private:
  struct Record {
    std::vector<uint8_t> skipped;
    int64_t longest = 0;
  };
  SequenceId insert(const std::function<void(SequenceId)>& create, Record record);
  Record& record(const char* operation, SequenceId sequence);
  const Record& record(const char* operation, SequenceId sequence) const;

  size_t num_layers_;
  int64_t max_sequences_;
  std::map<SequenceId, Record> records_;
  SequenceId next_ = 0;
};

}  // namespace dsv4
