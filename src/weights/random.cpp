// Deterministic random attention weights for any config, and the native-name checkpoint writer.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "dsv4/numeric.h"
#include "dsv4/weights.h"
#include "weights/weight_names.h"

namespace dsv4 {
namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A stream seed that depends on every key, so tensors and rows draw independent values.
uint64_t stream_seed(std::initializer_list<uint64_t> keys) {
  uint64_t state = 0;
  for (uint64_t k : keys) {
    state ^= k;
    state = splitmix64(state);
  }
  return state;
}

// Uniform in [-1, 1) with 53 random bits.
double uniform_signed(uint64_t& state) { return static_cast<double>(splitmix64(state) >> 11) * 0x1p-52 - 1.0; }

enum class Init : uint8_t {
  projection,  // N(0, 1/fan_in): outputs of unit-variance inputs stay of order one
  norm,        // 1 + U(-0.1, 0.1)
  small,       // N(0, 0.1^2): attention sinks and position biases
};

Init init_of(WeightRole r) {
  switch (r) {
    case WeightRole::q_norm: case WeightRole::kv_norm: case WeightRole::compressor_norm:
    case WeightRole::indexer_k_norm: case WeightRole::indexer_compressor_norm: case WeightRole::main_norm:
      return Init::norm;
    case WeightRole::attn_sink: case WeightRole::compressor_ape: case WeightRole::indexer_compressor_ape:
      return Init::small;
    default:
      return Init::projection;
  }
}

// One row of a tensor from its own stream, so that values depend only on (seed, layer, role, row),
// not on how rows are split among threads or whether the tensor is stored as fp8.
void fill_row(float* x, int64_t n, Init init, double stddev, uint64_t seed) {
  uint64_t state = seed;
  if (init == Init::norm) {
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(1.0 + 0.1 * uniform_signed(state));
    return;
  }
  for (int64_t i = 0; i < n; i += 2) {
    // Marsaglia's polar method: two independent standard normals per accepted point.
    double u, v, s;
    do {
      u = uniform_signed(state);
      v = uniform_signed(state);
      s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    const double factor = std::sqrt(-2.0 * std::log(s) / s) * stddev;
    x[i] = static_cast<float>(u * factor);
    if (i + 1 < n) x[i + 1] = static_cast<float>(v * factor);
  }
}

// What a random WeightTensor points into.
struct RandomStorage {
  HostTensor values;
  HostTensor scales;
};

// Weights are [rows, cols] matrices or vectors (one row).
int64_t rows_of(const std::vector<int64_t>& shape) { return shape.size() == 2 ? shape[0] : 1; }
int64_t cols_of(const std::vector<int64_t>& shape) { return shape.back(); }

// A band of rows of one tensor: the unit of parallel work.
struct Band {
  const ExpectedWeight* weight;
  RandomStorage* storage;
  uint64_t seed;
  int64_t row_begin, row_end;
};

// Stores the band's values x [rows, cols] as f32, bf16 or, when the storage has scales, as e4m3
// codes with one scale per block (the band is one block row): a ue8m0 power of two (or an fp32
// amax / 448) that fits the block's largest magnitude into the e4m3 range.
void store_band(const std::vector<float>& x, const Band& b, const std::optional<WeightQuantization>& q) {
  HostTensor& values = b.storage->values;
  const int64_t cols = cols_of(values.shape());
  const int64_t offset = b.row_begin * cols, n = (b.row_end - b.row_begin) * cols;
  if (values.dtype() == DType::f32) {
    std::memcpy(values.as<float>() + offset, x.data(), static_cast<size_t>(n) * sizeof(float));
  } else if (values.dtype() == DType::bf16) {
    for (int64_t i = 0; i < n; ++i) values.as<uint16_t>()[offset + i] = float_to_bf16_bits(x[i]);
  } else {
    HostTensor& scales = b.storage->scales;
    const int64_t block_row = b.row_begin / q->block_out, rows = b.row_end - b.row_begin;
    for (int64_t block_col = 0; block_col < scales.size(1); ++block_col) {
      const int64_t c0 = block_col * q->block_in, c1 = std::min(cols, c0 + q->block_in);
      float amax = 0.0f;
      for (int64_t r = 0; r < rows; ++r) amax = std::max(amax, abs_max(&x[r * cols + c0], static_cast<int>(c1 - c0)));
      const int64_t s = block_row * scales.size(1) + block_col;
      float scale = 0.0f;
      if (q->ue8m0_scales) {
        scales.as<uint8_t>()[s] = fp8_ue8m0_scale_byte(amax);
        scale = ue8m0_to_float(scales.as<uint8_t>()[s]);
      } else {
        scale = scales.as<float>()[s] = std::max(amax, kFp8AmaxFloor) / kE4m3Max;
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = c0; c < c1; ++c)
          values.as<uint8_t>()[offset + r * cols + c] = float_to_e4m3(x[r * cols + c] / scale);
    }
  }
}

// About this many elements per band of a tensor stored without fp8 blocks.
constexpr int64_t kBandElements = 1 << 16;

}  // namespace

ModelWeights random_weights(const ModelConfig& config, const ModelTopology& topology, uint64_t seed, bool fp8) {
  DSV4_CHECK(topology.size() == config.total_layers(), "weights: topology has ", topology.size(),
             " layers, the config ", config.total_layers());
  const std::optional<WeightQuantization> quantization = fp8 ? config.weight_quantization : std::nullopt;
  ModelWeights weights;
  weights.layers.resize(static_cast<size_t>(topology.size()));
  std::vector<std::vector<ExpectedWeight>> expected(static_cast<size_t>(topology.size()));
  std::vector<Band> bands;
  for (int l = 0; l < topology.size(); ++l) {
    LayerWeights& lw = weights.layers[static_cast<size_t>(l)];
    lw.layer = l;
    expected[static_cast<size_t>(l)] = expected_layer_weights(config, topology[l]);
    for (const ExpectedWeight& e : expected[static_cast<size_t>(l)]) {
      auto storage = std::make_shared<RandomStorage>();
      const bool as_fp8 = quantization && e.fp8_allowed;
      // Sinks are fp32, as in DeepSeek's checkpoints; everything else bf16 unless stored as fp8.
      storage->values = HostTensor(as_fp8 ? DType::e4m3 : e.role == WeightRole::attn_sink ? DType::f32 : DType::bf16,
                                   e.shape);
      WeightTensor w;
      w.name = weight_names::name_of(l, e.role, {});
      w.dtype = storage->values.dtype();
      w.shape = e.shape;
      w.data = storage->values.data();
      const int64_t rows = rows_of(e.shape);
      int64_t band_rows = std::max<int64_t>(1, kBandElements / std::max<int64_t>(1, cols_of(e.shape)));
      if (as_fp8) {
        storage->scales = HostTensor(quantization->ue8m0_scales ? DType::ue8m0 : DType::f32,
                                     {(e.shape[0] + quantization->block_out - 1) / quantization->block_out,
                                      (e.shape[1] + quantization->block_in - 1) / quantization->block_in});
        w.scale_dtype = storage->scales.dtype();
        w.scale_shape = storage->scales.shape();
        w.scale_data = storage->scales.data();
        w.block_out = quantization->block_out;
        w.block_in = quantization->block_in;
        band_rows = quantization->block_out;
      }
      const uint64_t tensor_seed = stream_seed({seed, static_cast<uint64_t>(l), static_cast<uint64_t>(e.role)});
      for (int64_t r = 0; r < rows; r += band_rows)
        bands.push_back({&e, storage.get(), tensor_seed, r, std::min(rows, r + band_rows)});
      w.owner = storage;
      lw.tensors[static_cast<int>(e.role)] = std::move(w);
    }
  }
  // One parallel region for the whole model: tensors are small and many.
#pragma omp parallel for schedule(dynamic)
  for (size_t i = 0; i < bands.size(); ++i) {
    const Band& b = bands[i];
    const int64_t cols = cols_of(b.weight->shape);
    const Init init = init_of(b.weight->role);
    const double stddev = init == Init::projection ? 1.0 / std::sqrt(static_cast<double>(cols)) : 0.1;
    std::vector<float> x(static_cast<size_t>((b.row_end - b.row_begin) * cols));
    for (int64_t r = b.row_begin; r < b.row_end; ++r)
      fill_row(&x[static_cast<size_t>((r - b.row_begin) * cols)], cols, init, stddev,
               stream_seed({b.seed, static_cast<uint64_t>(r)}));
    store_band(x, b, quantization);
  }
  return weights;
}

void save_weights(const ModelWeights& weights, const std::string& path) {
  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");
  for (const LayerWeights& lw : weights.layers) {
    for (int r = 0; r < kNumWeightRoles; ++r) {
      if (!lw.tensors[r]) continue;
      const WeightTensor& w = *lw.tensors[r];
      const auto role = static_cast<WeightRole>(r);
      writer.add(weight_names::name_of(lw.layer, role, {}), w.dtype, w.shape, w.data,
                 static_cast<size_t>(w.numel()) * dtype_size(w.dtype));
      if (w.is_fp8()) {
        int64_t scales = 1;
        for (int64_t d : w.scale_shape) scales *= d;
        writer.add(weight_names::name_of(lw.layer, role, {}, true), w.scale_dtype, w.scale_shape, w.scale_data,
                   static_cast<size_t>(scales) * dtype_size(w.scale_dtype));
      }
    }
  }
  writer.write(path);
}

}  // namespace dsv4
