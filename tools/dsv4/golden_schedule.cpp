#include "dsv4/golden_schedule.h"

#include <cstring>
#include <optional>
#include <string_view>

#include "dsv4/error.h"

namespace dsv4::cli {

std::string call_tensor_name(int call, const std::string& field) {
  return "calls." + std::to_string(call) + "." + field;
}

std::string layer_tensor_name(int call, int layer, const std::string& field) {
  return "calls." + std::to_string(call) + ".layers." + std::to_string(layer) + "." + field;
}

namespace {

// Parses a decimal number of at most 7 digits (no sign) followed by '.', consuming both.
std::optional<int> take_number(std::string_view& s) {
  size_t digits = 0;
  while (digits < s.size() && s[digits] >= '0' && s[digits] <= '9') ++digits;
  if (digits == 0 || digits > 7 || digits >= s.size() || s[digits] != '.') return std::nullopt;
  int value = 0;
  for (size_t i = 0; i < digits; ++i) value = value * 10 + (s[i] - '0');
  s.remove_prefix(digits + 1);
  return value;
}

bool take_prefix(std::string_view& s, std::string_view prefix) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  s.remove_prefix(prefix.size());
  return true;
}

}  // namespace

CallIndex::CallIndex(const SafetensorsFile& file) {
  for (const auto& entry : file.header().entries) {
    std::string_view rest = entry.name;
    if (!take_prefix(rest, "calls.")) continue;
    std::optional<int> call = take_number(rest);
    if (!call) continue;
    int layer = kCallLevel;
    if (take_prefix(rest, "layers.")) {
      std::optional<int> parsed = take_number(rest);
      if (!parsed) continue;
      layer = *parsed;
    }
    if (rest.empty()) continue;
    fields_[*call][layer].insert(std::string(rest));
  }
}

std::vector<int> CallIndex::calls() const {
  std::vector<int> out;
  for (const auto& [call, layers] : fields_) out.push_back(call);
  return out;
}

std::vector<int> CallIndex::layers(int call) const {
  std::vector<int> out;
  auto it = fields_.find(call);
  if (it == fields_.end()) return out;
  for (const auto& [layer, fields] : it->second)
    if (layer != kCallLevel) out.push_back(layer);
  return out;
}

bool CallIndex::has(int call, const std::string& field) const { return has(call, kCallLevel, field); }

bool CallIndex::has(int call, int layer, const std::string& field) const {
  auto c = fields_.find(call);
  if (c == fields_.end()) return false;
  auto l = c->second.find(layer);
  return l != c->second.end() && l->second.count(field) != 0;
}

const SafetensorsEntry& expect_tensor(const SafetensorsFile& file, const std::string& name, DType dtype,
                                      const std::vector<int64_t>& shape, const std::string& op,
                                      const std::string& shape_origin) {
  const SafetensorsEntry* entry = file.find(name);
  DSV4_CHECK(entry != nullptr, op, ": ", file.path(), " has no tensor '", name, "'");
  DSV4_CHECK(entry->dtype == dtype, op, ": ", name, " in ", file.path(), " has dtype ", dtype_name(entry->dtype),
             ", expected ", dtype_name(dtype));
  DSV4_CHECK(entry->shape == shape, op, ": ", name, " in ", file.path(), " has shape ", shape_string(entry->shape),
             ", expected ", shape_string(shape), " (", shape_origin, ")");
  return *entry;
}

const SafetensorsEntry& expect_activations(const SafetensorsFile& file, const std::string& name,
                                           const std::vector<int64_t>& shape, const std::string& op,
                                           const std::string& shape_origin) {
  const SafetensorsEntry* entry = file.find(name);
  DSV4_CHECK(entry != nullptr, op, ": ", file.path(), " has no tensor '", name, "'");
  DSV4_CHECK(is_activation_dtype(entry->dtype), op, ": ", name, " in ", file.path(), " has dtype ",
             dtype_name(entry->dtype), ", expected F32 or BF16");
  return expect_tensor(file, name, entry->dtype, shape, op, shape_origin);
}

std::vector<int64_t> read_integers(const SafetensorsFile& file, const SafetensorsEntry& entry) {
  const int64_t n = entry.numel();
  std::vector<int64_t> values(static_cast<size_t>(n));
  const std::byte* data = file.data(entry);
  // memcpy per element: the mapping gives no alignment guarantee for the tensor's data.
  if (entry.dtype == DType::i64) {
    std::memcpy(values.data(), data, static_cast<size_t>(n) * sizeof(int64_t));
  } else if (entry.dtype == DType::i32) {
    for (int64_t i = 0; i < n; ++i) {
      int32_t v;
      std::memcpy(&v, data + i * sizeof(int32_t), sizeof v);
      values[static_cast<size_t>(i)] = v;
    }
  } else {
    fail("read: ", entry.name, " in ", file.path(), " has dtype ", dtype_name(entry.dtype), ", expected I32 or I64");
  }
  return values;
}

int64_t ReplaySchedule::total_positions() const {
  return calls.empty() ? 0 : calls.back().first_position + calls.back().num_tokens;
}

ReplaySchedule read_replay_schedule(const SafetensorsFile& file, int64_t hidden_size) {
  const std::string op = "replay";
  const CallIndex index(file);
  const std::vector<int> calls = index.calls();
  DSV4_CHECK(!calls.empty(), op, ": ", file.path(), " has no 'calls.{c}.*' tensors");

  ReplaySchedule schedule;
  std::string batch_origin;  // the tensor B was taken from, for messages
  for (size_t i = 0; i < calls.size(); ++i) {
    const int c = calls[i];
    DSV4_CHECK(c == static_cast<int>(i), op, ": ", file.path(), " has no call ", i, " (calls are numbered 0..",
               calls.size() - 1, ", found call ", c, ")");

    // Positions: contiguous, continuing from the previous call (the engine appends at the end).
    const std::string positions_name = call_tensor_name(c, kPositionIds);
    const SafetensorsEntry* positions_entry = file.find(positions_name);
    DSV4_CHECK(positions_entry != nullptr, op, ": ", file.path(), " has no tensor '", positions_name, "'");
    DSV4_CHECK(positions_entry->dtype == DType::i64, op, ": ", positions_name, " has dtype ",
               dtype_name(positions_entry->dtype), ", expected I64");
    DSV4_CHECK(positions_entry->shape.size() == 1 && positions_entry->shape[0] >= 1, op, ": ", positions_name,
               " has shape ", shape_string(positions_entry->shape), ", expected [S] with S >= 1");
    const std::vector<int64_t> positions = read_integers(file, *positions_entry);
    ScheduledCall call{c, schedule.total_positions(), positions_entry->shape[0]};
    const std::string why = c == 0 ? "a new sequence starts at position 0"
                                   : "positions continue from the previous call's end, " +
                                         std::to_string(call.first_position);
    for (size_t t = 0; t < positions.size(); ++t)
      DSV4_CHECK(positions[t] == call.first_position + static_cast<int64_t>(t), op, ": ", positions_name, "[", t,
                 "] is ", positions[t], ", expected ", call.first_position + static_cast<int64_t>(t), " (", why, ")");

    // Layers: the same contiguous set 0..n-1 in every call.
    std::vector<int> layers;
    for (int l : index.layers(c))
      if (index.has(c, l, kHiddenIn)) layers.push_back(l);
    DSV4_CHECK(!layers.empty(), op, ": ", file.path(), " has no 'calls.", c, ".layers.{l}.hidden_in' tensors");
    for (size_t l = 0; l < layers.size(); ++l)
      DSV4_CHECK(layers[l] == static_cast<int>(l), op, ": ", file.path(), " has no tensor '",
                 layer_tensor_name(c, static_cast<int>(l), kHiddenIn), "' but has layer ", layers[l]);
    if (c == 0) {
      schedule.num_layers = static_cast<int>(layers.size());
    } else {
      DSV4_CHECK(static_cast<int>(layers.size()) == schedule.num_layers, op, ": call ", c, " has hidden_in for ",
                 layers.size(), " layers, expected ", schedule.num_layers, " (as call 0)");
    }

    for (int l : layers) {
      const std::string name = layer_tensor_name(c, l, kHiddenIn);
      if (schedule.batch == 0) {
        const SafetensorsEntry& first = file.at(name);
        DSV4_CHECK(first.shape.size() == 3 && first.shape[0] >= 1, op, ": ", name, " has shape ",
                   shape_string(first.shape), ", expected [B, ", call.num_tokens, ", ", hidden_size, "] with B >= 1");
        schedule.batch = first.shape[0];
        batch_origin = name;
      }
      expect_activations(file, name, {schedule.batch, call.num_tokens, hidden_size}, op,
                    "B from " + batch_origin + ", S from " + positions_name + ", hidden size from the config");
    }
    schedule.calls.push_back(call);
  }
  return schedule;
}

bool is_dspark_schedule(const SafetensorsFile& file) {
  return file.find(call_tensor_name(0, kMainHidden)) != nullptr;
}

namespace {

// An i64 [n >= 1] position tensor of consecutive positions first, first + 1, ...; returns first.
int64_t read_consecutive_positions(const SafetensorsFile& file, const std::string& name, int64_t expected_first,
                                   const std::string& why, int64_t* count) {
  const std::string op = "replay";
  const SafetensorsEntry* entry = file.find(name);
  DSV4_CHECK(entry != nullptr, op, ": ", file.path(), " has no tensor '", name, "'");
  DSV4_CHECK(entry->dtype == DType::i64, op, ": ", name, " has dtype ", dtype_name(entry->dtype), ", expected I64");
  DSV4_CHECK(entry->shape.size() == 1 && entry->shape[0] >= 1, op, ": ", name, " has shape ",
             shape_string(entry->shape), ", expected [n] with n >= 1");
  const std::vector<int64_t> positions = read_integers(file, *entry);
  const int64_t first = expected_first >= 0 ? expected_first : positions[0];
  for (size_t t = 0; t < positions.size(); ++t)
    DSV4_CHECK(positions[t] == first + static_cast<int64_t>(t), op, ": ", name, "[", t, "] is ", positions[t],
               ", expected ", first + static_cast<int64_t>(t), " (", why, ")");
  *count = entry->shape[0];
  return first;
}

}  // namespace

DsparkSchedule read_dspark_schedule(const SafetensorsFile& file, int64_t hidden_size, int64_t main_width,
                                    int64_t block_size, int stages) {
  const std::string op = "replay";
  const CallIndex index(file);
  const std::vector<int> calls = index.calls();
  DsparkSchedule schedule;
  int64_t length = 0;
  for (size_t i = 0; i < calls.size(); ++i) {
    const int c = calls[i];
    DSV4_CHECK(c == static_cast<int>(i), op, ": ", file.path(), " has no call ", i, " (calls are numbered 0..",
               calls.size() - 1, ", found call ", c, ")");
    DsparkCall call{c, 0, 0, false};
    const std::string main_name = call_tensor_name(c, kMainPositionIds);
    const SafetensorsEntry* main_entry = file.find(main_name);
    DSV4_CHECK(main_entry != nullptr, op, ": ", file.path(), " has no tensor '", main_name, "' (a DSpark set)");
    // A new sequence starts at 0; otherwise the rows continue the sequences.
    const bool restart = main_entry->shape.size() == 1 && main_entry->shape[0] >= 1 &&
                         read_integers(file, *main_entry)[0] == 0;
    if (restart) length = 0;
    DSV4_CHECK(c > 0 || restart, op, ": ", main_name, " must start at position 0 (call 0 begins the sequences)");
    call.first_main_position = read_consecutive_positions(
        file, main_name, length, restart ? "a new sequence starts at 0" : "the rows continue the sequences, whose length is " + std::to_string(length),
        &call.main_rows);
    length += call.main_rows;

    const std::string hidden_name = call_tensor_name(c, kMainHidden);
    if (schedule.batch == 0) {
      const SafetensorsEntry* first = file.find(hidden_name);
      DSV4_CHECK(first != nullptr && first->shape.size() == 3 && first->shape[0] >= 1, op, ": ", hidden_name,
                 first ? " has shape " + shape_string(first->shape) : std::string(" is missing"), ", expected [B, ",
                 call.main_rows, ", ", main_width, "] with B >= 1");
      schedule.batch = first->shape[0];
    }
    expect_activations(file, hidden_name, {schedule.batch, call.main_rows, main_width}, op,
                       "B from call 0, n from " + main_name + ", hidden_size x dspark_target_layer_ids from the config");

    call.draft = index.has(c, 0, kHiddenIn);
    if (call.draft) {
      int64_t block = 0;
      read_consecutive_positions(file, call_tensor_name(c, kPositionIds), length,
                                 "a draft block follows the last committed position", &block);
      DSV4_CHECK(block == block_size, op, ": ", call_tensor_name(c, kPositionIds), " has ", block,
                 " positions, expected dspark_block_size = ", block_size);
      for (int l = 0; l < stages; ++l)
        expect_activations(file, layer_tensor_name(c, l, kHiddenIn), {schedule.batch, block_size, hidden_size}, op,
                           "B from call 0, the block from dspark_block_size, hidden size from the config");
      DSV4_CHECK(!index.has(c, stages, kHiddenIn), op, ": ", file.path(), " has '",
                 layer_tensor_name(c, stages, kHiddenIn), "', but the config has ", stages, " draft stages");
    }
    schedule.longest_sequence = std::max(schedule.longest_sequence, length + (call.draft ? block_size : 0));
    schedule.calls.push_back(call);
  }
  DSV4_CHECK(!schedule.calls.empty(), op, ": ", file.path(), " has no 'calls.{c}.*' tensors");
  return schedule;
}

}  // namespace dsv4::cli
