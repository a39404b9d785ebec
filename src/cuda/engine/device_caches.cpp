#include "cuda/engine/device_caches.h"

#include <utility>

namespace dsv4::cuda {
namespace {

constexpr std::array<CacheKind, 3> kKinds = {CacheKind::window, CacheKind::compressed, CacheKind::index_keys};

}  // namespace

namespace {

// The manager keeps the bookkeeping only: the pool bytes live in the arenas, the compressor state
// in the rings.
KvCacheOptions device_options(KvCacheOptions options, const std::vector<std::vector<int64_t>>& ring_floats) {
  options.host_storage = false;
  options.compressor_state_floats.clear();
  for (const std::vector<int64_t>& rings : ring_floats) {
    int64_t sum = 0;
    for (int64_t floats : rings) sum += floats;
    options.compressor_state_floats.push_back(sum);
  }
  return options;
}

}  // namespace

DeviceCaches::DeviceCaches(const ModelConfig& config, const ModelTopology& topology, KvCacheOptions options,
                           const std::vector<std::vector<int64_t>>& ring_floats, cudaStream_t stream)
    : manager_(config, topology, device_options(std::move(options), ring_floats)), stream_(stream) {
  const int layers = topology.size();
  arena_of_layer_.assign(static_cast<size_t>(layers), {-1, -1, -1});
  for (int l = 0; l < layers; ++l)
    for (CacheKind kind : kKinds) {
      if (!manager_.has_pool(kind, l)) continue;
      const PagePool& pool = manager_.pool(kind, l);
      DSV4_CHECK(!pool.float_storage(), "engine: create: pool '", pool.name(),
                 "' stores fp32 rows; the cuda backend needs a row format");
      arena_of_layer_[static_cast<size_t>(l)][static_cast<size_t>(kind)] = static_cast<int>(arenas_.size());
      arenas_.push_back({kind, l, DeviceBuffer(static_cast<size_t>(pool.num_pages() * pool.page_stride()))});
      // Page padding and never-written rows are read by no kernel, but zeroed bytes keep the
      // arena deterministic for anyone inspecting it.
      if (arenas_.back().bytes.bytes() > 0)
        DSV4_CUDA_CHECK(cudaMemsetAsync(arenas_.back().bytes.data(), 0, arenas_.back().bytes.bytes(), stream_));
    }
  const int64_t sequences = manager_.options().capacity.max_sequences;
  rings_.resize(static_cast<size_t>(layers));
  for (int l = 0; l < layers; ++l)
    for (int64_t floats : ring_floats[static_cast<size_t>(l)]) {
      Ring ring{floats, DeviceBuffer(static_cast<size_t>(floats * sequences) * sizeof(float))};
      DSV4_CUDA_CHECK(cudaMemsetAsync(ring.slab.data(), 0, ring.slab.bytes(), stream_));
      rings_[static_cast<size_t>(l)].push_back(std::move(ring));
    }
}

const DeviceCaches::Arena& DeviceCaches::arena(CacheKind kind, int layer) const {
  manager_.pool(kind, layer);  // throws naming the layer when it has no such pool
  return arenas_[static_cast<size_t>(arena_of_layer_[static_cast<size_t>(layer)][static_cast<size_t>(kind)])];
}

TensorView DeviceCaches::pages(CacheKind kind, int layer) const {
  const PagePool& pool = manager_.pool(kind, layer);
  return arena(kind, layer).bytes.view(DType::u8, {pool.num_pages(), pool.page_stride()});
}

TensorView DeviceCaches::compressor_ring(int layer, int ring, int64_t ring_rows, int64_t row_width) const {
  DSV4_CHECK(layer >= 0 && static_cast<size_t>(layer) < rings_.size() && ring >= 0 &&
                 static_cast<size_t>(ring) < rings_[static_cast<size_t>(layer)].size(),
             "engine: layer ", layer, " has no compressor ring ", ring);
  const Ring& r = rings_[static_cast<size_t>(layer)][static_cast<size_t>(ring)];
  DSV4_CHECK(ring_rows * row_width == r.floats, "engine: layer ", layer, " compressor ring ", ring, " holds ",
             r.floats, " floats per sequence, not ", ring_rows, " x ", row_width);
  return r.slab.view(DType::f32, {manager_.options().capacity.max_sequences, ring_rows, row_width});
}

int64_t DeviceCaches::device_bytes() const {
  int64_t bytes = 0;
  for (const Arena& a : arenas_) bytes += static_cast<int64_t>(a.bytes.bytes());
  for (const std::vector<Ring>& rings : rings_)
    for (const Ring& r : rings) bytes += static_cast<int64_t>(r.slab.bytes());
  return bytes;
}

void DeviceCaches::add_sequence(SequenceId id) {
  manager_.add_sequence(id);
  const int64_t slot = manager_.sequence_slot(id);
  for (const std::vector<Ring>& rings : rings_)
    for (const Ring& r : rings) {
      auto* base = static_cast<float*>(r.slab.data());
      DSV4_CUDA_CHECK(cudaMemsetAsync(base + slot * r.floats, 0, static_cast<size_t>(r.floats) * sizeof(float), stream_));
    }
}

void DeviceCaches::fork_sequence(SequenceId parent, SequenceId child) {
  manager_.fork_sequence(parent, child);
  const int64_t from = manager_.sequence_slot(parent), to = manager_.sequence_slot(child);
  for (const std::vector<Ring>& rings : rings_)
    for (const Ring& r : rings) {
      auto* base = static_cast<float*>(r.slab.data());
      DSV4_CUDA_CHECK(cudaMemcpyAsync(base + to * r.floats, base + from * r.floats,
                                      static_cast<size_t>(r.floats) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    }
}

void DeviceCaches::release_sequence(SequenceId id) { manager_.release_sequence(id); }

void DeviceCaches::reserve(const std::vector<CacheStepEntry>& step) {
  for (const PageCopy& c : manager_.reserve(step)) {
    const PagePool& pool = manager_.pool(c.kind, c.layer);
    auto* base = static_cast<std::byte*>(arena(c.kind, c.layer).bytes.data());
    const int64_t stride = pool.page_stride();
    DSV4_CUDA_CHECK(cudaMemcpyAsync(base + c.to * stride, base + c.from * stride, static_cast<size_t>(stride),
                                    cudaMemcpyDeviceToDevice, stream_));
  }
}

}  // namespace dsv4::cuda
