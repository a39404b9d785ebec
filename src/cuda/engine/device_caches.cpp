#include "cuda/engine/device_caches.h"

#include <algorithm>
#include <span>
#include <utility>

namespace dsv4::cuda {
namespace {

constexpr std::array<CacheKind, 3> kKinds = {CacheKind::window, CacheKind::compressed, CacheKind::index_keys};
// The changed tables are uploaded through a staging buffer of this size, in batches.
constexpr size_t kTableUploadBytes = size_t{1} << 20;

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
                           const std::vector<std::vector<int64_t>>& ring_floats, int64_t max_context,
                           int64_t max_step_tokens, cudaStream_t stream)
    : manager_(config, topology, device_options(std::move(options), ring_floats)), stream_(stream),
      table_upload_(kTableUploadBytes) {
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

  // Block-table mirrors. A window table holds the pages from the first kept row (length − window −
  // rollback rows) to the end of a step's rows; a compressed one every entry of max_context tokens.
  const KvCacheOptions& o = manager_.options();
  pool_tables_.resize(manager_.pools().size());
  std::vector<int64_t> offsets(pool_tables_.size());
  int64_t ints = 0;
  for (int l = 0; l < layers; ++l)
    for (CacheKind kind : kKinds) {
      if (!manager_.has_pool(kind, l)) continue;
      const int index = manager_.pool_index(kind, l);
      const PagePool& pool = manager_.pool(kind, l);
      const int64_t rpp = pool.rows_per_page(), per_row = manager_.tokens_per_row(kind, l);
      const int64_t rows = kind == CacheKind::window ? manager_.sliding_window() + o.rollback_rows + max_step_tokens
                                                     : max_context / per_row;
      const int64_t width = std::min(pool.num_pages(), (rows + rpp - 1) / rpp + 2);
      DSV4_CHECK(width <= INT32_MAX && pool.num_pages() <= INT32_MAX, "engine: create: pool '", pool.name(), "' has ",
                 pool.num_pages(), " pages, more than i32 block tables address");
      DevicePoolTable& t = pool_tables_[static_cast<size_t>(index)];
      t.width = static_cast<int32_t>(width);
      t.rows_per_page = static_cast<int32_t>(rpp);
      t.tokens_per_row = static_cast<int32_t>(per_row);
      offsets[static_cast<size_t>(index)] = ints;
      ints += (width + 1) * sequences;
    }
  tables_ = DeviceBuffer(static_cast<size_t>(ints) * sizeof(int32_t));
  // Free slots read as empty tables: every page -1.
  if (ints > 0) DSV4_CUDA_CHECK(cudaMemsetAsync(tables_.data(), 0xff, tables_.bytes(), stream_));
  for (size_t i = 0; i < pool_tables_.size(); ++i) {
    DevicePoolTable& t = pool_tables_[i];
    t.table = static_cast<int32_t*>(tables_.data()) + offsets[i];
    t.first = t.table + int64_t{t.width} * sequences;
  }
  pool_table_array_ = DeviceBuffer(pool_tables_.size() * sizeof(DevicePoolTable));
  pool_table_array_.upload(pool_tables_.data(), pool_table_array_.bytes(), stream_);
}

PagedCache DeviceCaches::paged(CacheKind kind, int layer) const {
  const DevicePoolTable& t = pool_tables_[static_cast<size_t>(manager_.pool_index(kind, layer))];
  const int64_t sequences = manager_.options().capacity.max_sequences;
  int device = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&device));
  PagedCache cache;
  cache.pages = pages(kind, layer);
  cache.geometry = geometry(kind, layer);
  cache.tensor_scale = manager_.pool(kind, layer).tensor_scale();
  cache.block_table = TensorView::contiguous(t.table, DType::i32, {sequences, t.width}, Device::cuda, device);
  cache.first_logical_page = TensorView::contiguous(t.first, DType::i32, {sequences}, Device::cuda, device);
  return cache;
}

void DeviceCaches::upload_table_changes() {
  const std::vector<KvCacheManager::TableChange> changes = manager_.take_table_changes();
  // In batches that fit the staging buffer: records first, then their pages.
  size_t next = 0;
  while (next < changes.size()) {
    std::vector<TableChangeRecord> records;
    std::vector<int32_t> pages;
    size_t bytes = 0;
    for (; next < changes.size(); ++next) {
      const KvCacheManager::TableChange& c = changes[next];
      const BlockTableView t = manager_.slot_block_table(c.pool, c.slot);
      const DevicePoolTable& mirror = pool_tables_[static_cast<size_t>(c.pool)];
      DSV4_CHECK(static_cast<int64_t>(t.pages.size()) <= mirror.width, "engine: the block table of sequence slot ",
                 c.slot, " in pool '", manager_.pools()[static_cast<size_t>(c.pool)]->name(), "' holds ",
                 t.pages.size(), " pages, more than the ", mirror.width, " planned at create");
      const size_t more = sizeof(TableChangeRecord) + t.pages.size() * sizeof(int32_t);
      if (!records.empty() && align_workspace(bytes + more) + 2 * kWorkspaceAlignment > kTableUploadBytes) break;
      records.push_back({c.pool, static_cast<int32_t>(c.slot), static_cast<int32_t>(t.first_logical_page),
                         static_cast<int32_t>(t.pages.size()), static_cast<int32_t>(pages.size()), 0});
      for (const int64_t page : t.pages) pages.push_back(static_cast<int32_t>(page));
      bytes += more;
    }
    table_upload_.begin();  // waits until the previous batch has left the staging buffer
    const TensorView r = table_upload_.append(records.data(), records.size() * sizeof(TableChangeRecord), DType::u8,
                                              {static_cast<int64_t>(records.size() * sizeof(TableChangeRecord))});
    const TensorView p = table_upload_.append(std::span<const int32_t>(pages), DType::i32,
                                              {static_cast<int64_t>(pages.size())});
    table_upload_.upload(stream_);
    launch_apply_table_changes(static_cast<const TableChangeRecord*>(r.data), static_cast<int64_t>(records.size()),
                               p.ptr<const int32_t>(), device_pool_tables(), stream_);
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
