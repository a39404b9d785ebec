#include "engine/sequence_registry.h"

#include <algorithm>

#include "dsv4/error.h"

namespace dsv4 {

SequenceId SequenceRegistry::insert(const std::function<void(SequenceId)>& create, std::vector<uint8_t> skipped) {
  DSV4_CHECK(static_cast<int64_t>(skipped_.size()) < max_sequences_, "engine: ", skipped_.size(),
             " sequences are live, the maximum is ", max_sequences_, " (EngineOptions::max_sequences)");
  const SequenceId id = next_;
  create(id);
  ++next_;
  skipped_.emplace(id, std::move(skipped));
  return id;
}

SequenceId SequenceRegistry::add(const std::function<void(SequenceId)>& create) {
  return insert(create, std::vector<uint8_t>(num_layers_, 0));
}

SequenceId SequenceRegistry::fork(SequenceId parent, const std::function<void(SequenceId)>& create) {
  return insert(create, skipped_layers("fork_sequence", parent));
}

void SequenceRegistry::remove(SequenceId sequence) {
  skipped_layers("release_sequence", sequence);
  skipped_.erase(sequence);
}

std::vector<uint8_t>& SequenceRegistry::skipped_layers(const char* operation, SequenceId sequence) {
  auto it = skipped_.find(sequence);
  DSV4_CHECK(it != skipped_.end(), "engine: ", operation, ": sequence ", sequence, " does not exist");
  return it->second;
}

const std::vector<uint8_t>& SequenceRegistry::skipped_layers(const char* operation, SequenceId sequence) const {
  return const_cast<SequenceRegistry*>(this)->skipped_layers(operation, sequence);
}

bool step_contains(const std::vector<StepEntry>& entries, SequenceId sequence) {
  return std::any_of(entries.begin(), entries.end(), [&](const StepEntry& e) { return e.sequence == sequence; });
}

}  // namespace dsv4
