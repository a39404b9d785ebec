// The golden "calls" format (tests/data/golden/README.upstream.md) that `dsv4 replay` reads and
// writes and `dsv4 compare` compares: a schedule of forward calls over B sequences that all sit
// at the same positions, with each layer's input and output per call.
//
//   calls.{c}.position_ids           i64 [S_c]            absolute positions of call c's tokens
//   calls.{c}.layers.{l}.hidden_in   f32 [B, S_c, hidden] input of layer l's attention
//   calls.{c}.layers.{l}.attn_out    f32 [B, S_c, hidden] its output
//   (sets made by DeepSeek's code, v40o_a, v41ds_a, store these two as bf16: read exactly as f32)
//   calls.{c}.layers.{l}.topk        i64 / i32 [B, S_c, k] picks of an index layer, -1 = none
//   calls.{c}.layers.{l}.topk_pos    i32 [B, S_c, k]      V4.1 reference picks, -1 = none
//   calls.{c}.layers.{l}.ambiguous   u8  [B, S_c]         1 where the reference's pick is not unique
//   calls.{c}.image_spans            i64 / i32 [n, 3]     optional: image spans of call c (SPEC §14),
//                                                         rows (sequence b, first, last position)
//
// Other names (`state.*`, `calls.{c}.cand_mask`, ...) are allowed and ignored here.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "dsv4/safetensors.h"

namespace dsv4::cli {

// Field names of the format.
inline constexpr const char* kPositionIds = "position_ids";
inline constexpr const char* kHiddenIn = "hidden_in";
inline constexpr const char* kAttnOut = "attn_out";
inline constexpr const char* kTopk = "topk";
inline constexpr const char* kTopkPos = "topk_pos";
inline constexpr const char* kAmbiguous = "ambiguous";
inline constexpr const char* kMainPositionIds = "main_position_ids";
inline constexpr const char* kMainHidden = "main_hidden";
inline constexpr const char* kImageSpans = "image_spans";

std::string call_tensor_name(int call, const std::string& field);              // calls.{c}.{field}
std::string layer_tensor_name(int call, int layer, const std::string& field);  // calls.{c}.layers.{l}.{field}

// The `calls.*` names of a file, grouped by call and layer.
class CallIndex {
 public:
  explicit CallIndex(const SafetensorsFile& file);
  // Call numbers that have at least one tensor, ascending.
  std::vector<int> calls() const;
  // Layers of `call` that have at least one tensor, ascending.
  std::vector<int> layers(int call) const;
  bool has(int call, const std::string& field) const;
  bool has(int call, int layer, const std::string& field) const;

 private:
  static constexpr int kCallLevel = -1;  // layer key of call-level fields such as position_ids
  std::map<int, std::map<int, std::set<std::string>>> fields_;
};

// The entry `name` of `file`, checked to have `dtype` and `shape`; `op` starts the message and
// `shape_origin` says where the expected shape comes from. Throws e.g.
// "dsv4: replay: calls.3.layers.1.hidden_in has shape [2, 5, 256], expected [2, 1, 256] (...)".
const SafetensorsEntry& expect_tensor(const SafetensorsFile& file, const std::string& name, DType dtype,
                                      const std::vector<int64_t>& shape, const std::string& op,
                                      const std::string& shape_origin);

// Activation tensors (hidden_in, attn_out) are F32, or BF16 (widened exactly).
inline bool is_activation_dtype(DType dtype) { return dtype == DType::f32 || dtype == DType::bf16; }

// The entry `name` of `file`, checked to be an activation tensor (F32 or BF16) of `shape`.
const SafetensorsEntry& expect_activations(const SafetensorsFile& file, const std::string& name,
                                           const std::vector<int64_t>& shape, const std::string& op,
                                           const std::string& shape_origin);

// Integer tensor values (i32 or i64) as int64, copied out of the mapping.
std::vector<int64_t> read_integers(const SafetensorsFile& file, const SafetensorsEntry& entry);

struct ScheduledCall {
  int index = 0;
  int64_t first_position = 0;
  int64_t num_tokens = 0;  // S_c
};

// What `dsv4 replay` runs: every call in order over `batch` sequences, each layer 0..num_layers-1
// fed its recorded hidden_in.
struct ReplaySchedule {
  int64_t batch = 0;
  int num_layers = 0;
  std::vector<ScheduledCall> calls;
  int64_t total_positions() const;
};

// Checks the whole schedule before anything runs: calls numbered 0..C-1, each with position_ids
// i64 [S_c] continuing from the previous call's end (the first call starts at 0), hidden_in f32 or
// bf16 [B, S_c, hidden_size] for the same layers 0..n-1 in every call, one B throughout. Errors name
// the tensor, what was expected and what was given.
ReplaySchedule read_replay_schedule(const SafetensorsFile& file, int64_t hidden_size);

// A DSpark set (v41ds_a, SPEC §13.1): per call the target model's rows and, for a draft call, one
// block per sequence through every draft stage (layers.{l}, l the stage):
//   calls.{c}.main_position_ids  i64 [n_c]                       positions of the call's main rows
//   calls.{c}.main_hidden        f32/bf16 [B, n_c, hidden · targets]  main_proj's input
//   calls.{c}.position_ids       i64 [block]                     draft calls: positions of the block rows
//   calls.{c}.layers.{l}.hidden_in  f32/bf16 [B, block, hidden]  draft calls: stage l's block rows
// Main positions continue the sequences' lengths; a call whose main positions start at 0 begins new
// sequences. A draft call's block sits right after its main rows.
bool is_dspark_schedule(const SafetensorsFile& file);

struct DsparkCall {
  int index = 0;
  int64_t first_main_position = 0;
  int64_t main_rows = 0;
  bool draft = false;  // has a block
};

struct DsparkSchedule {
  int64_t batch = 0;
  std::vector<DsparkCall> calls;
  int64_t longest_sequence = 0;  // committed positions plus a block
};

// Checks the whole schedule against the config's DSpark geometry before anything runs.
DsparkSchedule read_dspark_schedule(const SafetensorsFile& file, int64_t hidden_size, int64_t main_width,
                                    int64_t block_size, int stages);

}  // namespace dsv4::cli
