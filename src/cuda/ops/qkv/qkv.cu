// rms_norm, rope_heads and cache_insert: validation and mapping onto the row pipeline kernel.
#include <cmath>

#include "cuda/common/check_args.h"
#include "cuda/common/row_pipeline.h"
#include "dsv4/cuda/qkv.h"

namespace dsv4::cuda {
namespace {

const std::vector<DType> kFloatTypes = {DType::bf16, DType::f32};

void check_rope_table(const char* op, const TensorView& table, int64_t dims) {
  const int64_t rope_dim = table.shape[1];
  DSV4_CHECK(rope_dim % 2 == 0 && rope_dim <= dims, op, ": argument 'rope_table' has ", rope_dim,
             " columns, expected an even rope_dim <= ", dims);
}

void check_quant(const char* op, RowQuantizer quant, int64_t dims, int64_t rope_dim) {
  const int channels = quantized_channels(quant, static_cast<int>(dims), static_cast<int>(rope_dim));
  DSV4_CHECK(quant == RowQuantizer::none || quant == RowQuantizer::fp8_e4m3_nope_64 || channels % quant_tile(quant) == 0, op,
             ": a row of ", dims, " channels does not split into quantization tiles of ", quant_tile(quant));
}

void check_hadamard(const char* op, bool hadamard, int64_t dims) {
  DSV4_CHECK(!hadamard || (dims & (dims - 1)) == 0, op, ": a Hadamard rotation of rows of ", dims,
             " channels, expected a power of two");
}

void check_eps(const char* op, float eps) {
  DSV4_CHECK(std::isfinite(eps) && eps > 0.0f, op, ": eps is ", eps, ", expected finite and > 0");
}

void check_dims(const char* op, int64_t dims) {
  DSV4_CHECK(dims <= 16384, op, ": rows of ", dims, " channels exceed the supported 16384");
}

}  // namespace

HostTensor rope_table(const std::vector<float>& frequencies, int64_t max_positions) {
  DSV4_CHECK(max_positions >= 0, "rope_table: max_positions is ", max_positions, ", expected >= 0");
  const int64_t pairs = static_cast<int64_t>(frequencies.size());
  HostTensor table(DType::f32, {max_positions, 2 * pairs});
  float* data = table.as<float>();
  for (int64_t p = 0; p < max_positions; ++p)
    for (int64_t i = 0; i < pairs; ++i) {
      const float angle = static_cast<float>(p) * frequencies[static_cast<size_t>(i)];
      data[p * 2 * pairs + i] = std::cos(angle);
      data[p * 2 * pairs + pairs + i] = std::sin(angle);
    }
  return table;
}

void validate_rms_norm(const RmsNormParams& p) {
  constexpr const char* op = "rms_norm";
  const int64_t dims = p.x.shape[1];
  check_tensors(op, {
      {"x", &p.x, {kAnyDim, kAnyDim}, kFloatTypes},
      {"weight", &p.weight, {dims}, kFloatTypes, true},
      {"out", &p.out, {p.x.shape[0], dims}, kFloatTypes},
  });
  check_eps(op, p.eps);
  check_dims(op, dims);
}

void run_rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  validate_rms_norm(p);
  RowPipelineLaunch a;
  a.set_input(p.x);
  a.set_norm(p.weight, p.eps);
  a.bf16_rounding = p.out.dtype == DType::bf16;
  a.out = p.out.data;
  a.out_dtype = p.out.dtype;
  launch_row_pipeline(a, stream, "rms_norm");
}

void validate_rope_heads(const RopeHeadsParams& p) {
  constexpr const char* op = "rope_heads";
  const int64_t tokens = p.x.shape[0], heads = p.x.shape[1], dims = p.x.shape[2];
  check_tensors(op, {
      {"x", &p.x, {kAnyDim, kAnyDim, kAnyDim}, kFloatTypes},
      {"token_position", &p.token_position, {tokens}, {DType::i32}},
      {"rope_table", &p.rope_table, {kAnyDim, kAnyDim}, {DType::f32}},
      {"out", &p.out, {tokens, heads, dims}, kFloatTypes},
  });
  check_rope_table(op, p.rope_table, dims);
  check_quant(op, p.quant, dims, p.rope_table.shape[1]);
  check_hadamard(op, p.hadamard, dims);
  if (p.head_norm) check_eps(op, p.eps);
  check_dims(op, dims);
  DSV4_CHECK(heads <= INT32_MAX, op, ": ", heads, " heads are too many");
}

void run_rope_heads(const RopeHeadsParams& p, cudaStream_t stream) {
  validate_rope_heads(p);
  RowPipelineLaunch a;
  a.set_input(p.x);
  if (p.head_norm) a.set_norm({}, p.eps);
  a.set_rope(p.rope_table, p.token_position);
  a.inverse_rope = p.inverse;
  a.bf16_rounding = p.out.dtype == DType::bf16;
  a.hadamard = p.hadamard;
  a.quant = p.quant;
  a.out = p.out.data;
  a.out_dtype = p.out.dtype;
  launch_row_pipeline(a, stream, "rope_heads");
}

void validate_cache_insert(const CacheInsertParams& p) {
  constexpr const char* op = "cache_insert";
  const int64_t tokens = p.rows.shape[0], dims = p.rows.shape[1];
  std::vector<TensorSpec> specs = {
      {"rows", &p.rows, {kAnyDim, kAnyDim}, kFloatTypes},
      {"norm_weight", &p.norm_weight, {dims}, kFloatTypes, true},
      {"token_position", &p.token_position, {tokens}, {DType::i32}, !is_present(p.rope_table)},
      {"rope_table", &p.rope_table, {kAnyDim, kAnyDim}, {DType::f32}, true},
      {"slots", &p.slots, {tokens}, {DType::i64}},
  };
  for (TensorSpec& s : paged_cache_specs("cache", p.cache, false, kAnyDim)) specs.push_back(std::move(s));
  specs.push_back({"out", &p.out, {tokens, dims}, kFloatTypes, true});
  check_tensors(op, specs);
  const bool rotated = is_present(p.rope_table);
  if (rotated) check_rope_table(op, p.rope_table, dims);
  check_quant(op, p.quant, dims, rotated ? p.rope_table.shape[1] : 0);
  check_hadamard(op, p.hadamard, dims);
  if (is_present(p.norm_weight)) check_eps(op, p.eps);
  check_dims(op, dims);
  check_paged_cache(op, "cache", p.cache, dims, kEveryKvRowFormat);
}

void run_cache_insert(const CacheInsertParams& p, cudaStream_t stream) {
  validate_cache_insert(p);
  RowPipelineLaunch a;
  a.set_input(p.rows);
  if (is_present(p.norm_weight)) a.set_norm(p.norm_weight, p.eps);
  if (is_present(p.rope_table)) a.set_rope(p.rope_table, p.token_position);
  a.position_offset = p.position_offset;
  a.bf16_rounding = p.bf16_rounding;
  a.hadamard = p.hadamard;
  a.quant = p.quant;
  if (is_present(p.out)) {
    a.out = p.out.data;
    a.out_dtype = p.out.dtype;
  }
  a.cache = device_rows(p.cache);
  a.slots = p.slots.ptr<const int64_t>();
  launch_row_pipeline(a, stream, "cache_insert");
}

}  // namespace dsv4::cuda
