#include "engine/sequence_registry.h"

#include <algorithm>
#include <set>

#include "dsv4/error.h"

namespace dsv4 {

SequenceId SequenceRegistry::insert(const std::function<void(SequenceId)>& create, Record record) {
  DSV4_CHECK(static_cast<int64_t>(records_.size()) < max_sequences_, "engine: ", records_.size(),
             " sequences are live, the maximum is ", max_sequences_, " (EngineOptions::max_sequences)");
  const SequenceId id = next_;
  create(id);
  ++next_;
  records_.emplace(id, std::move(record));
  return id;
}

SequenceId SequenceRegistry::add(const std::function<void(SequenceId)>& create) {
  return insert(create, {.skipped = std::vector<uint8_t>(num_layers_, 0)});
}

SequenceId SequenceRegistry::fork(SequenceId parent, const std::function<void(SequenceId)>& create) {
  return insert(create, record("fork_sequence", parent));
}

void SequenceRegistry::remove(SequenceId sequence) {
  record("release_sequence", sequence);
  records_.erase(sequence);
}

SequenceRegistry::Record& SequenceRegistry::record(const char* operation, SequenceId sequence) {
  auto it = records_.find(sequence);
  DSV4_CHECK(it != records_.end(), "engine: ", operation, ": sequence ", sequence, " does not exist");
  return it->second;
}

const SequenceRegistry::Record& SequenceRegistry::record(const char* operation, SequenceId sequence) const {
  return const_cast<SequenceRegistry*>(this)->record(operation, sequence);
}

std::vector<uint8_t>& SequenceRegistry::skipped_layers(const char* operation, SequenceId sequence) {
  return record(operation, sequence).skipped;
}

const std::vector<uint8_t>& SequenceRegistry::skipped_layers(const char* operation, SequenceId sequence) const {
  return record(operation, sequence).skipped;
}

int64_t SequenceRegistry::longest_length(const char* operation, SequenceId sequence) const {
  return record(operation, sequence).longest;
}

void SequenceRegistry::note_length(SequenceId sequence, int64_t length) {
  int64_t& longest = record("note_length", sequence).longest;
  longest = std::max(longest, length);
}

void SequenceRegistry::check_step(const std::vector<StepEntry>& entries, const EngineOptions& options,
                                  const std::function<int64_t(SequenceId)>& length) const {
  DSV4_CHECK(!entries.empty(), "engine: begin_step: a step needs at least one entry");
  std::set<SequenceId> seen;
  int64_t tokens = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const StepEntry& e = entries[i];
    skipped_layers("begin_step", e.sequence);
    const int64_t committed = length(e.sequence);
    DSV4_CHECK(seen.insert(e.sequence).second, "engine: begin_step: sequence ", e.sequence,
               " appears more than once in the step");
    DSV4_CHECK(e.num_tokens >= 1, "engine: begin_step: entry ", i, " (sequence ", e.sequence, ") has num_tokens ",
               e.num_tokens, ", expected >= 1");
    DSV4_CHECK(e.num_tokens <= options.max_tokens_per_step - tokens, "engine: begin_step: the step has more than ",
               options.max_tokens_per_step, " tokens (EngineOptions::max_tokens_per_step)");
    DSV4_CHECK(e.num_tokens <= options.max_context - committed, "engine: begin_step: sequence ", e.sequence,
               " would grow to ", committed + e.num_tokens, " tokens, beyond max_context ", options.max_context);
    tokens += e.num_tokens;
  }
}

}  // namespace dsv4
