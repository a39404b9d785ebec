// Page pools and the model-wide paged KV-cache manager (include/dsv4/kv_cache.h, docs/caches.md).
#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "dsv4/error.h"
#include "dsv4/kv_cache.h"

namespace dsv4 {

namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// Far above any serving setup, low enough that page and state products stay in int64.
constexpr int64_t kMaxSequences = int64_t{1} << 20;
constexpr int64_t kMaxTokens = int64_t{1} << 40;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string format_label(const std::optional<KvRowFormat>& f) {
  return f ? kv_row_format_name(*f) : "f32";
}

}  // namespace

// =============================================================================================
// PagePool

PagePool::PagePool(PoolSpec spec) : spec_(std::move(spec)) {
  DSV4_CHECK(spec_.dims > 0, "kv_cache: pool '", spec_.name, "': dims is ", spec_.dims,
             ", expected > 0");
  DSV4_CHECK(spec_.rows_per_page > 0, "kv_cache: pool '", spec_.name, "': rows_per_page is ",
             spec_.rows_per_page, ", expected > 0");
  DSV4_CHECK(spec_.num_pages >= 0, "kv_cache: pool '", spec_.name, "': num_pages is ",
             spec_.num_pages, ", expected >= 0");
  if (spec_.format) {
    geometry_ = page_geometry(*spec_.format, spec_.dims, spec_.rows_per_page, spec_.placement);
    page_stride_ = geometry_->page_stride;
  } else {
    DSV4_CHECK(spec_.dims <= kInt64Max / 4 / spec_.rows_per_page, "kv_cache: pool '", spec_.name,
               "': a page of ", spec_.rows_per_page, " rows x ", spec_.dims, " floats is too large");
    row_bytes_ = spec_.dims * static_cast<int64_t>(sizeof(float));
    page_stride_ = spec_.rows_per_page * row_bytes_;
  }
  DSV4_CHECK(spec_.num_pages == 0 || page_stride_ <= kInt64Max / spec_.num_pages,
             "kv_cache: pool '", spec_.name, "': ", spec_.num_pages, " pages of ", page_stride_,
             " bytes overflow");
  if (spec_.host_storage) {
    bytes_.assign(static_cast<size_t>(spec_.num_pages * page_stride_), std::byte{0});
    written_.assign(static_cast<size_t>(spec_.num_pages * spec_.rows_per_page), 0);
  }
  refcount_.assign(static_cast<size_t>(spec_.num_pages), 0);
  free_list_.reserve(static_cast<size_t>(spec_.num_pages));
  for (int64_t p = spec_.num_pages - 1; p >= 0; --p) free_list_.push_back(p);
}

const PageGeometry& PagePool::geometry() const {
  DSV4_CHECK(geometry_.has_value(), "kv_cache: pool '", spec_.name,
             "' stores fp32 rows and has no row-format geometry");
  return *geometry_;
}

void PagePool::check_page(const char* operation, int64_t page) const {
  DSV4_CHECK(page >= 0 && page < spec_.num_pages, "kv_cache: ", operation, " in pool '", spec_.name,
             "': page ", page, " is out of range [0, ", spec_.num_pages, ")");
}

void PagePool::check_host(const char* operation) const {
  DSV4_CHECK(spec_.host_storage, "kv_cache: ", operation, " in pool '", spec_.name,
             "': the pool keeps no host bytes (host_storage is off)");
}

void PagePool::check_slot(const char* operation, int64_t slot) const {
  const int64_t slots = spec_.num_pages * spec_.rows_per_page;
  DSV4_CHECK(slot >= 0 && slot < slots, "kv_cache: ", operation, " in pool '", spec_.name,
             "': slot ", slot, " is out of range [0, ", slots, ")");
}

int64_t PagePool::page_offset(int64_t page) const {
  check_page("page_offset", page);
  return page * page_stride_;
}

std::string PagePool::exhausted_message(int64_t asked) const {
  std::ostringstream os;
  os << "dsv4: kv_cache: pool '" << spec_.name << "' is exhausted: asked for " << asked
     << (asked == 1 ? " page, " : " pages, ") << free_pages() << " free of " << spec_.num_pages;
  return os.str();
}

std::vector<int64_t> PagePool::allocate(int64_t n) {
  DSV4_CHECK(n >= 0, "kv_cache: allocate in pool '", spec_.name, "': asked for ", n,
             " pages, expected >= 0");
  if (n > free_pages()) throw Error(exhausted_message(n));
  std::vector<int64_t> pages(static_cast<size_t>(n));
  for (auto& page : pages) {
    page = free_list_.back();
    free_list_.pop_back();
    refcount_[page] = 1;
    if (spec_.host_storage)
      std::fill_n(written_.begin() + page * spec_.rows_per_page, spec_.rows_per_page, uint8_t{0});
  }
  return pages;
}

void PagePool::retain(int64_t page) {
  check_page("retain", page);
  DSV4_CHECK(refcount_[page] > 0, "kv_cache: retain in pool '", spec_.name, "': page ", page,
             " is free");
  ++refcount_[page];
}

void PagePool::release(int64_t page) {
  check_page("release", page);
  DSV4_CHECK(refcount_[page] > 0, "kv_cache: release in pool '", spec_.name, "': page ", page,
             " is already free");
  if (--refcount_[page] == 0) free_list_.push_back(page);
}

int32_t PagePool::refcount(int64_t page) const {
  check_page("refcount", page);
  return refcount_[page];
}

PoolStats PagePool::stats() const {
  PoolStats s;
  s.total_pages = spec_.num_pages;
  s.free_pages = free_pages();
  s.used_pages = static_cast<int64_t>(std::count_if(refcount_.begin(), refcount_.end(),
                                                    [](int32_t r) { return r > 0; }));
  s.shared_pages = static_cast<int64_t>(std::count_if(refcount_.begin(), refcount_.end(),
                                                      [](int32_t r) { return r > 1; }));
  s.page_bytes = page_stride_;
  return s;
}

void PagePool::copy_page(int64_t from, int64_t to) {
  check_page("copy_page", from);
  check_page("copy_page", to);
  DSV4_CHECK(refcount_[from] > 0 && refcount_[to] > 0, "kv_cache: copy_page in pool '", spec_.name,
             "': pages ", from, " -> ", to, " must both be in use (reference counts ",
             refcount_[from], ", ", refcount_[to], ")");
  if (!spec_.host_storage) return;
  std::memcpy(bytes_.data() + to * page_stride_, bytes_.data() + from * page_stride_,
              static_cast<size_t>(page_stride_));
  std::copy_n(written_.begin() + from * spec_.rows_per_page, spec_.rows_per_page,
              written_.begin() + to * spec_.rows_per_page);
}

bool PagePool::is_written(int64_t slot) const {
  check_host("is_written");
  check_slot("is_written", slot);
  return written_[slot] != 0;
}

void PagePool::write_rows(const float* x, int64_t n, const int64_t* slots) {
  DSV4_CHECK(n >= 0, "kv_cache: write_rows in pool '", spec_.name, "': row count ", n,
             ", expected >= 0");
  check_host("write_rows");
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    check_slot("write_rows", slots[i]);
    const int64_t page = slots[i] / spec_.rows_per_page;
    DSV4_CHECK(refcount_[page] == 1, "kv_cache: write_rows in pool '", spec_.name, "': slot ",
               slots[i], " is on page ", page, " with reference count ", refcount_[page],
               ", expected 1 (a free page is not writable, a shared one must be copied first)");
  }
  if (geometry_) {
    encode_rows(*geometry_, x, n, slots, bytes_.data(), spec_.tensor_scale);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    if (!geometry_) {
      const int64_t page = slots[i] / spec_.rows_per_page, row = slots[i] % spec_.rows_per_page;
      std::memcpy(bytes_.data() + page * page_stride_ + row * row_bytes_, x + i * spec_.dims,
                  static_cast<size_t>(row_bytes_));
    }
    written_[slots[i]] = 1;
  }
}

void PagePool::read_rows(const int64_t* slots, int64_t n, float* out) const {
  DSV4_CHECK(n >= 0, "kv_cache: read_rows in pool '", spec_.name, "': row count ", n,
             ", expected >= 0");
  check_host("read_rows");
  for (int64_t i = 0; i < n; ++i) {
    check_slot("read_rows", slots[i]);
    const int64_t page = slots[i] / spec_.rows_per_page;
    DSV4_CHECK(refcount_[page] > 0, "kv_cache: read_rows in pool '", spec_.name, "': slot ",
               slots[i], " is on page ", page, ", which is free");
    DSV4_CHECK(written_[slots[i]] != 0, "kv_cache: read_rows in pool '", spec_.name, "': slot ",
               slots[i], " (page ", page, ", row ", slots[i] % spec_.rows_per_page,
               ") has not been written");
  }
  if (geometry_) {
    decode_rows(*geometry_, bytes_.data(), slots, n, out, spec_.tensor_scale);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t page = slots[i] / spec_.rows_per_page, row = slots[i] % spec_.rows_per_page;
    std::memcpy(out + i * spec_.dims, bytes_.data() + page * page_stride_ + row * row_bytes_,
                static_cast<size_t>(row_bytes_));
  }
}

// =============================================================================================
// KvCacheManager

const char* cache_kind_name(CacheKind k) {
  switch (k) {
    case CacheKind::window: return "window";
    case CacheKind::compressed: return "compressed";
    case CacheKind::index_keys: return "index keys";
  }
  return "?";
}

namespace {

std::optional<KvRowFormat> kind_format(const KvCacheOptions& o, CacheKind k) {
  if (!o.formats) return std::nullopt;
  switch (k) {
    case CacheKind::window: return o.formats->window;
    case CacheKind::compressed: return o.formats->compressed;
    case CacheKind::index_keys: return o.formats->index_keys;
  }
  return std::nullopt;
}

int64_t kind_rows_per_page(const KvCacheOptions& o, CacheKind k) {
  const int64_t requested = k == CacheKind::window       ? o.window_rows_per_page
                            : k == CacheKind::compressed ? o.compressed_rows_per_page
                                                         : o.index_key_rows_per_page;
  DSV4_CHECK(requested >= 0, "kv_cache: ", cache_kind_name(k), " rows per page is ", requested,
             ", expected >= 0 (0: the format's default)");
  if (requested > 0) return requested;
  return default_rows_per_page(kind_format(o, k).value_or(KvRowFormat::bf16));
}

int64_t kind_dims(const ModelConfig& c, CacheKind k) {
  return k == CacheKind::index_keys ? c.index_head_dim : c.head_dim;
}

void check_topology(const ModelConfig& config, const ModelTopology& topology) {
  DSV4_CHECK(topology.size() == config.total_layers(), "kv_cache: topology has ", topology.size(),
             " layers, expected ", config.total_layers(), " (config '", config.name, "')");
  DSV4_CHECK(config.sliding_window > 0, "kv_cache: sliding_window is ", config.sliding_window,
             ", expected > 0");
  for (int l = 0; l < topology.size(); ++l) {
    const LayerPlan& plan = topology[l];
    DSV4_CHECK(plan.layer == l, "kv_cache: topology entry ", l, " describes layer ", plan.layer);
    DSV4_CHECK(!(plan.owns_compressor || plan.owns_index_keys) || plan.compress_ratio > 0,
               "kv_cache: layer ", plan.layer, " owns a compressed cache but has compress ratio ",
               plan.compress_ratio, ", expected > 0");
  }
}

}  // namespace

KvCacheCapacity plan_kv_cache_capacity(const ModelConfig& config, const ModelTopology& topology,
                                       const KvCacheOptions& options, int64_t max_sequences,
                                       int64_t max_context, int64_t max_step_tokens) {
  check_topology(config, topology);
  DSV4_CHECK(max_sequences > 0 && max_sequences <= kMaxSequences && max_context > 0 &&
                 max_context <= kMaxTokens && max_step_tokens > 0 && max_step_tokens <= kMaxTokens,
             "kv_cache: plan_kv_cache_capacity: max_sequences ", max_sequences, ", max_context ",
             max_context, ", max_step_tokens ", max_step_tokens, ": expected sequences in [1, ",
             kMaxSequences, "] and token counts in [1, ", kMaxTokens, "]");
  KvCacheCapacity cap;
  cap.max_sequences = max_sequences;
  // Between steps a sequence holds positions [L - W - R, L) (R: rollback_rows); a step appends n
  // more. The positions [L - W - R, L + n) touch at most (W + R + n - 1) / rpp + 2 pages, and the n
  // sum to max_step_tokens.
  const int64_t window = config.sliding_window + options.rollback_rows;
  const int64_t rpp_w = kind_rows_per_page(options, CacheKind::window);
  cap.window_pages = std::min((max_sequences * (window - 1) + max_step_tokens) / rpp_w + 2 * max_sequences,
                              max_sequences * ceil_div(max_context, rpp_w));
  for (const LayerPlan& plan : topology.layers) {
    const int64_t entries = max_context / std::max(plan.compress_ratio, 1);
    if (plan.owns_compressor) {
      const int64_t rpp = kind_rows_per_page(options, CacheKind::compressed);
      cap.compressed_pages = std::max(cap.compressed_pages, max_sequences * ceil_div(entries, rpp));
    }
    if (plan.owns_index_keys) {
      const int64_t rpp = kind_rows_per_page(options, CacheKind::index_keys);
      cap.index_key_pages = std::max(cap.index_key_pages, max_sequences * ceil_div(entries, rpp));
    }
  }
  return cap;
}

KvCacheManager::KvCacheManager(const ModelConfig& config, const ModelTopology& topology,
                               KvCacheOptions options)
    : options_(std::move(options)), window_(config.sliding_window) {
  check_topology(config, topology);
  const KvCacheCapacity& cap = options_.capacity;
  DSV4_CHECK(cap.max_sequences > 0 && cap.max_sequences <= kMaxSequences,
             "kv_cache: capacity.max_sequences is ", cap.max_sequences, ", expected in [1, ",
             kMaxSequences, "]");
  DSV4_CHECK(cap.window_pages >= 0 && cap.compressed_pages >= 0 && cap.index_key_pages >= 0,
             "kv_cache: capacity pages (window ", cap.window_pages, ", compressed ",
             cap.compressed_pages, ", index keys ", cap.index_key_pages, ") must be >= 0");
  const int layers = topology.size();
  DSV4_CHECK(options_.rollback_rows >= 0 && options_.rollback_rows <= kMaxTokens, "kv_cache: rollback_rows is ",
             options_.rollback_rows, ", expected a count in [0, ", kMaxTokens, "]");
  auto& floats = options_.compressor_state_floats;
  DSV4_CHECK(floats.empty() || static_cast<int>(floats.size()) == layers,
             "kv_cache: compressor_state_floats has ", floats.size(), " entries, expected ", layers,
             " (one per layer) or none");
  if (floats.empty()) floats.assign(static_cast<size_t>(layers), 0);

  pool_of_layer_.assign(static_cast<size_t>(layers), {-1, -1, -1});
  state_slabs_.resize(static_cast<size_t>(layers));
  auto add_pool = [&](const LayerPlan& plan, CacheKind kind, int64_t tokens_per_row, int64_t pages) {
    PoolSpec spec;
    spec.format = kind_format(options_, kind);
    spec.name = "layer " + std::to_string(plan.layer) + " " + cache_kind_name(kind) + " (" +
                format_label(spec.format) + ")";
    spec.dims = kind_dims(config, kind);
    spec.rows_per_page = kind_rows_per_page(options_, kind);
    spec.num_pages = pages;
    spec.placement = options_.placement;
    spec.tensor_scale = options_.fp8_tensor_scale;
    spec.host_storage = options_.host_storage;
    pool_of_layer_[plan.layer][static_cast<size_t>(kind)] = static_cast<int>(pools_.size());
    pools_.push_back(CachePool{kind, plan.layer, tokens_per_row, PagePool(std::move(spec))});
  };
  for (const LayerPlan& plan : topology.layers) {
    add_pool(plan, CacheKind::window, 1, cap.window_pages);
    if (plan.owns_compressor) add_pool(plan, CacheKind::compressed, plan.compress_ratio, cap.compressed_pages);
    if (plan.owns_index_keys) add_pool(plan, CacheKind::index_keys, plan.compress_ratio, cap.index_key_pages);
    const int64_t n = floats[plan.layer];
    DSV4_CHECK(n >= 0, "kv_cache: compressor_state_floats[", plan.layer, "] is ", n, ", expected >= 0");
    DSV4_CHECK(n == 0 || plan.owns_compressor, "kv_cache: compressor_state_floats[", plan.layer,
               "] is ", n, ", but layer ", plan.layer, " owns no compressor (expected 0)");
    DSV4_CHECK(n <= kInt64Max / cap.max_sequences, "kv_cache: compressor_state_floats[", plan.layer,
               "] = ", n, " x ", cap.max_sequences, " sequences overflows");
    if (options_.host_storage) state_slabs_[plan.layer].assign(static_cast<size_t>(n * cap.max_sequences), 0.0f);
  }
  for (int64_t s = cap.max_sequences - 1; s >= 0; --s) free_slots_.push_back(s);
  slot_sequence_.assign(static_cast<size_t>(cap.max_sequences), nullptr);
  table_change_listed_.assign(pools_.size() * static_cast<size_t>(cap.max_sequences), 0);
}

// ----- lookups

int KvCacheManager::pool_index(CacheKind kind, int layer) const {
  DSV4_CHECK(layer >= 0 && layer < static_cast<int>(pool_of_layer_.size()), "kv_cache: layer ",
             layer, " is out of range [0, ", pool_of_layer_.size(), ")");
  const int index = pool_of_layer_[layer][static_cast<size_t>(kind)];
  DSV4_CHECK(index >= 0, "kv_cache: layer ", layer, " has no ", cache_kind_name(kind),
             " cache (only kv-source layers own compressed and index-key caches)");
  return index;
}

bool KvCacheManager::has_pool(CacheKind kind, int layer) const {
  return layer >= 0 && layer < static_cast<int>(pool_of_layer_.size()) &&
         pool_of_layer_[layer][static_cast<size_t>(kind)] >= 0;
}

const PagePool& KvCacheManager::pool(CacheKind kind, int layer) const {
  return pools_[pool_index(kind, layer)].pages;
}

int64_t KvCacheManager::tokens_per_row(CacheKind kind, int layer) const {
  return pools_[pool_index(kind, layer)].tokens_per_row;
}

std::vector<const PagePool*> KvCacheManager::pools() const {
  std::vector<const PagePool*> out;
  for (const CachePool& p : pools_) out.push_back(&p.pages);
  return out;
}

KvCacheManager::Sequence& KvCacheManager::sequence(const char* operation, SequenceId id) {
  auto it = sequences_.find(id);
  DSV4_CHECK(it != sequences_.end(), "kv_cache: ", operation, ": sequence ", id, " does not exist");
  return it->second;
}

const KvCacheManager::Sequence& KvCacheManager::sequence(const char* operation, SequenceId id) const {
  auto it = sequences_.find(id);
  DSV4_CHECK(it != sequences_.end(), "kv_cache: ", operation, ": sequence ", id, " does not exist");
  return it->second;
}

int64_t KvCacheManager::first_kept_row(const CachePool& p, int64_t length) const {
  return p.kind == CacheKind::window ? std::max<int64_t>(0, length - window_ - options_.rollback_rows) : 0;
}

int64_t KvCacheManager::held_rows(const CachePool& p, const BlockTable& t) const {
  return (t.first_logical_page + static_cast<int64_t>(t.pages.size())) * p.pages.rows_per_page();
}

std::string KvCacheManager::row_name(const CachePool& p, SequenceId id, int64_t row) const {
  std::ostringstream os;
  os << "sequence " << id << " layer " << p.layer << " " << cache_kind_name(p.kind)
     << (p.kind == CacheKind::window ? " position " : " entry ") << row;
  return os.str();
}

int64_t KvCacheManager::checked_slot(size_t pool, SequenceId id, const Sequence& s,
                                     int64_t row) const {
  const CachePool& p = pools_[pool];
  const BlockTable& t = s.tables[pool];
  const int64_t first = first_kept_row(p, s.length);
  DSV4_CHECK(row >= first, "kv_cache: ", row_name(p, id, row),
             p.kind == CacheKind::window ? " has left the window" : " does not exist",
             " (rows from ", first, " are kept at length ", s.length, ")");
  DSV4_CHECK(row < held_rows(p, t), "kv_cache: ", row_name(p, id, row),
             " is not reserved (pages cover rows below ", held_rows(p, t), "; reserve the step first)");
  const int64_t rpp = p.pages.rows_per_page();
  return t.pages[row / rpp - t.first_logical_page] * rpp + row % rpp;
}

int64_t KvCacheManager::first_readable_row(SequenceId id, CacheKind kind, int layer) const {
  return first_kept_row(pools_[pool_index(kind, layer)], sequence("first_readable_row", id).length);
}

int64_t KvCacheManager::held_rows(SequenceId id, CacheKind kind, int layer) const {
  const int index = pool_index(kind, layer);
  return held_rows(pools_[index], sequence("held_rows", id).tables[index]);
}

int64_t KvCacheManager::slot(SequenceId id, CacheKind kind, int layer, int64_t row) const {
  return checked_slot(pool_index(kind, layer), id, sequence("slot", id), row);
}

BlockTableView KvCacheManager::block_table(SequenceId id, CacheKind kind, int layer) const {
  const int index = pool_index(kind, layer);
  const BlockTable& t = sequence("block_table", id).tables[index];
  return BlockTableView{t.first_logical_page, t.pages};
}

std::vector<SequenceId> KvCacheManager::sequences() const {
  std::vector<SequenceId> ids;
  for (const auto& [id, s] : sequences_) ids.push_back(id);
  return ids;
}

int64_t KvCacheManager::sequence_length(SequenceId id) const {
  return sequence("sequence_length", id).length;
}

int64_t KvCacheManager::sequence_bytes(SequenceId id) const {
  const Sequence& s = sequence("sequence_bytes", id);
  int64_t bytes = 0;
  for (size_t i = 0; i < pools_.size(); ++i)
    bytes += static_cast<int64_t>(s.tables[i].pages.size()) * pools_[i].pages.page_stride();
  for (const int64_t floats : options_.compressor_state_floats)
    bytes += floats * static_cast<int64_t>(sizeof(float));
  return bytes;
}

// ----- sequence lifetime

int64_t KvCacheManager::take_sequence_slot(const char* operation, SequenceId id) {
  DSV4_CHECK(!sequences_.count(id), "kv_cache: ", operation, ": sequence ", id, " already exists");
  DSV4_CHECK(!free_slots_.empty(), "kv_cache: ", operation, ": sequence ", id, ": all ",
             options_.capacity.max_sequences, " sequence slots are in use");
  const int64_t slot = free_slots_.back();
  free_slots_.pop_back();
  return slot;
}

void KvCacheManager::add_sequence(SequenceId id) {
  Sequence s;
  s.slot = take_sequence_slot("add_sequence", id);
  s.tables.resize(pools_.size());
  if (options_.host_storage)
    for (size_t layer = 0; layer < state_slabs_.size(); ++layer) {
      const int64_t n = options_.compressor_state_floats[layer];
      std::fill_n(state_slabs_[layer].begin() + s.slot * n, n, 0.0f);
    }
  const Sequence& added = sequences_.emplace(id, std::move(s)).first->second;
  slot_sequence_[static_cast<size_t>(added.slot)] = &added;
  all_tables_changed(added);
}

void KvCacheManager::fork_sequence(SequenceId parent, SequenceId child) {
  const Sequence& from = sequence("fork_sequence", parent);
  Sequence s;
  s.slot = take_sequence_slot("fork_sequence", child);
  s.length = from.length;
  s.tables.resize(pools_.size());
  for (size_t i = 0; i < pools_.size(); ++i) {
    CachePool& p = pools_[i];
    const BlockTable& t = from.tables[i];
    // Only pages with committed rows come along; pages the parent reserved past them stay its own.
    const int64_t pages = ceil_div(rows_at(p, from.length), p.pages.rows_per_page()) - t.first_logical_page;
    s.tables[i].first_logical_page = t.first_logical_page;
    for (int64_t k = 0; k < pages; ++k) {
      p.pages.retain(t.pages[k]);
      s.tables[i].pages.push_back(t.pages[k]);
    }
  }
  if (options_.host_storage)
    for (size_t layer = 0; layer < state_slabs_.size(); ++layer) {
      const int64_t n = options_.compressor_state_floats[layer];
      std::copy_n(state_slabs_[layer].begin() + from.slot * n, n,
                  state_slabs_[layer].begin() + s.slot * n);
    }
  const Sequence& added = sequences_.emplace(child, std::move(s)).first->second;
  slot_sequence_[static_cast<size_t>(added.slot)] = &added;
  all_tables_changed(added);
}

void KvCacheManager::table_changed(size_t pool, const Sequence& s) {
  uint8_t& listed = table_change_listed_[pool * slot_sequence_.size() + static_cast<size_t>(s.slot)];
  if (listed) return;
  listed = 1;
  table_changes_.push_back({static_cast<int>(pool), s.slot});
}

void KvCacheManager::all_tables_changed(const Sequence& s) {
  for (size_t i = 0; i < pools_.size(); ++i) table_changed(i, s);
}

std::vector<KvCacheManager::TableChange> KvCacheManager::take_table_changes() {
  for (const TableChange& c : table_changes_)
    table_change_listed_[static_cast<size_t>(c.pool) * slot_sequence_.size() + static_cast<size_t>(c.slot)] = 0;
  return std::exchange(table_changes_, {});
}

BlockTableView KvCacheManager::slot_block_table(int pool, int64_t slot) const {
  DSV4_CHECK(pool >= 0 && static_cast<size_t>(pool) < pools_.size() && slot >= 0 &&
                 static_cast<size_t>(slot) < slot_sequence_.size(),
             "kv_cache: slot_block_table: pool ", pool, " slot ", slot, " out of range [0, ", pools_.size(), ") x [0, ",
             slot_sequence_.size(), ")");
  const Sequence* s = slot_sequence_[static_cast<size_t>(slot)];
  if (!s) return {};
  const BlockTable& t = s->tables[static_cast<size_t>(pool)];
  return {t.first_logical_page, t.pages};
}

void KvCacheManager::release_pages(Sequence& s) {
  for (size_t i = 0; i < pools_.size(); ++i) {
    for (const int64_t page : s.tables[i].pages) pools_[i].pages.release(page);
    s.tables[i].pages.clear();
  }
}

void KvCacheManager::release_sequence(SequenceId id) {
  Sequence& s = sequence("release_sequence", id);
  release_pages(s);
  all_tables_changed(s);
  slot_sequence_[static_cast<size_t>(s.slot)] = nullptr;
  free_slots_.push_back(s.slot);
  sequences_.erase(id);
}

// ----- steps

namespace {

std::string describe_step(const std::vector<CacheStepEntry>& step,
                          const std::vector<int64_t>& lengths) {
  constexpr size_t kListed = 4;
  std::ostringstream os;
  for (size_t i = 0; i < step.size() && i < kListed; ++i) {
    os << (i ? ", " : "") << "sequence " << step[i].sequence << ": " << step[i].new_tokens
       << (step[i].new_tokens == 1 ? " token" : " tokens") << " at length " << lengths[i];
  }
  if (step.size() > kListed) os << ", and " << step.size() - kListed << " more sequences";
  return os.str();
}

}  // namespace

std::vector<PageCopy> KvCacheManager::reserve(const std::vector<CacheStepEntry>& step) {
  // Validate the request before planning anything.
  std::vector<Sequence*> seqs;
  std::vector<int64_t> lengths;
  std::set<SequenceId> seen;
  for (const CacheStepEntry& e : step) {
    Sequence& s = sequence("reserve", e.sequence);
    DSV4_CHECK(e.new_tokens > 0, "kv_cache: reserve: sequence ", e.sequence, " asks for ",
               e.new_tokens, " new tokens, expected > 0");
    DSV4_CHECK(e.new_tokens <= kInt64Max - s.length, "kv_cache: reserve: sequence ", e.sequence,
               " at length ", s.length, " + ", e.new_tokens, " new tokens overflows");
    DSV4_CHECK(seen.insert(e.sequence).second, "kv_cache: reserve: sequence ", e.sequence,
               " appears twice in the step");
    seqs.push_back(&s);
    lengths.push_back(s.length);
  }

  // Plan: per pool, the pages to append and the shared pages to copy. Page counts are computed
  // before any list is built, so that an absurd request fails on the count alone.
  struct Copy {
    size_t sequence;  // index into step
    size_t table_index;
  };
  struct PoolPlan {
    std::vector<int64_t> appended;  // per step entry: pages to append
    std::vector<Copy> copies;
    int64_t need = 0;
  };
  std::vector<PoolPlan> plans(pools_.size());
  auto exhausted = [&](size_t pool, int64_t need) {
    throw Error(pools_[pool].pages.exhausted_message(need) + " (reserving " +
                describe_step(step, lengths) + ")");
  };
  for (size_t i = 0; i < pools_.size(); ++i) {
    const CachePool& p = pools_[i];
    const int64_t rpp = p.pages.rows_per_page();
    PoolPlan& plan = plans[i];
    plan.appended.assign(step.size(), 0);
    // References to a shared page that earlier entries of this step copy away: once they are
    // gone, the last holder writes in place.
    std::unordered_map<int64_t, int32_t> copied_away;
    for (size_t e = 0; e < step.size(); ++e) {
      const BlockTable& t = seqs[e]->tables[i];
      const int64_t first_row = rows_at(p, lengths[e]);
      const int64_t end_row = rows_at(p, lengths[e] + step[e].new_tokens);
      if (end_row == first_row) continue;
      const int64_t held_end = t.first_logical_page + static_cast<int64_t>(t.pages.size());
      const int64_t first_page = first_row / rpp, end_page = ceil_div(end_row, rpp);
      for (int64_t lp = first_page; lp < std::min(end_page, held_end); ++lp) {
        const size_t k = static_cast<size_t>(lp - t.first_logical_page);
        const int64_t page = t.pages[k];
        if (p.pages.refcount(page) - copied_away[page] > 1) {
          ++copied_away[page];
          plan.copies.push_back(Copy{e, k});
        }
      }
      plan.appended[e] = std::max<int64_t>(0, end_page - held_end);
      // More than the whole pool can never fit; checking it here keeps the sum below small.
      if (plan.appended[e] > p.pages.num_pages()) exhausted(i, plan.appended[e]);
      plan.need += plan.appended[e];
    }
    plan.need += static_cast<int64_t>(plan.copies.size());
  }
  for (size_t i = 0; i < pools_.size(); ++i) {
    if (plans[i].need > pools_[i].pages.free_pages()) exhausted(i, plans[i].need);
  }

  // Execute: nothing below can fail.
  std::vector<PageCopy> copies;
  for (size_t i = 0; i < pools_.size(); ++i) {
    PagePool& pool = pools_[i].pages;
    const std::vector<int64_t> fresh = pool.allocate(plans[i].need);
    auto next = fresh.begin();
    for (const Copy& c : plans[i].copies) {
      int64_t& page = seqs[c.sequence]->tables[i].pages[c.table_index];
      pool.copy_page(page, *next);
      copies.push_back(PageCopy{pools_[i].kind, pools_[i].layer, page, *next});
      pool.release(page);
      page = *next++;
      table_changed(i, *seqs[c.sequence]);
    }
    for (size_t e = 0; e < step.size(); ++e) {
      if (plans[i].appended[e] == 0) continue;
      auto& pages = seqs[e]->tables[i].pages;
      pages.insert(pages.end(), next, next + plans[i].appended[e]);
      next += plans[i].appended[e];
      table_changed(i, *seqs[e]);
    }
  }
  return copies;
}

LayerStepSlots KvCacheManager::step_slots(const std::vector<CacheStepEntry>& step, int layer) const {
  LayerStepSlots out;
  const int window = pool_index(CacheKind::window, layer);
  const int compressed = has_pool(CacheKind::compressed, layer) ? pool_index(CacheKind::compressed, layer) : -1;
  const int index_keys = has_pool(CacheKind::index_keys, layer) ? pool_index(CacheKind::index_keys, layer) : -1;
  // A kernel writes these slots directly, so each must be on a page this sequence owns alone.
  auto writable_slot = [&](int pool, SequenceId id, const Sequence& s, int64_t row) {
    const CachePool& p = pools_[pool];
    const int64_t slot = checked_slot(pool, id, s, row);
    const int64_t page = slot / p.pages.rows_per_page();
    DSV4_CHECK(p.pages.refcount(page) == 1, "kv_cache: step_slots: ", row_name(p, id, row),
               " is on page ", page, " shared by ", p.pages.refcount(page),
               " holders (reserve the step first)");
    return slot;
  };
  auto closing_slot = [&](int pool, SequenceId id, const Sequence& s, int64_t position) {
    const int64_t ratio = pools_[pool].tokens_per_row;
    return (position + 1) % ratio != 0 ? int64_t{-1} : writable_slot(pool, id, s, (position + 1) / ratio - 1);
  };
  std::set<SequenceId> seen;
  for (const CacheStepEntry& e : step) {
    const Sequence& s = sequence("step_slots", e.sequence);
    DSV4_CHECK(e.new_tokens > 0, "kv_cache: step_slots: sequence ", e.sequence, " has ",
               e.new_tokens, " new tokens, expected > 0");
    DSV4_CHECK(seen.insert(e.sequence).second, "kv_cache: step_slots: sequence ", e.sequence,
               " appears twice in the step");
    for (int64_t p = s.length; p - s.length < e.new_tokens; ++p) {
      out.window.push_back(writable_slot(window, e.sequence, s, p));
      if (compressed >= 0) out.compressed.push_back(closing_slot(compressed, e.sequence, s, p));
      if (index_keys >= 0) out.index_keys.push_back(closing_slot(index_keys, e.sequence, s, p));
    }
  }
  return out;
}

void KvCacheManager::commit(SequenceId id, int64_t new_length) {
  Sequence& s = sequence("commit", id);
  DSV4_CHECK(new_length >= s.length, "kv_cache: commit: sequence ", id, " new length ", new_length,
             " is below its length ", s.length);
  for (size_t i = 0; i < pools_.size(); ++i) {
    const CachePool& p = pools_[i];
    DSV4_CHECK(rows_at(p, new_length) <= held_rows(p, s.tables[i]), "kv_cache: commit: sequence ",
               id, " to length ", new_length, " needs ", rows_at(p, new_length), " rows in pool '",
               p.pages.name(), "', but only ", held_rows(p, s.tables[i]),
               " are reserved (reserve the step first)");
  }
  s.length = new_length;
  for (size_t i = 0; i < pools_.size(); ++i) {
    const CachePool& p = pools_[i];
    if (p.kind != CacheKind::window) continue;
    BlockTable& t = s.tables[i];
    const int64_t drop = first_kept_row(p, new_length) / p.pages.rows_per_page() - t.first_logical_page;
    if (drop <= 0) continue;
    for (int64_t k = 0; k < drop; ++k) pools_[i].pages.release(t.pages[k]);
    t.pages.erase(t.pages.begin(), t.pages.begin() + drop);
    t.first_logical_page += drop;
    table_changed(i, s);
  }
}

void KvCacheManager::rollback(SequenceId id, int64_t new_length) {
  Sequence& s = sequence("rollback", id);
  DSV4_CHECK(new_length >= 0 && new_length <= s.length, "kv_cache: rollback: sequence ", id, " to length ",
             new_length, ", expected a length in [0, ", s.length, "]");
  for (size_t i = 0; i < pools_.size(); ++i) {
    const CachePool& p = pools_[i];
    const int64_t rpp = p.pages.rows_per_page();
    BlockTable& t = s.tables[i];
    // The rows the sequence reads at its new length must still be there (window pages leave
    // rollback_rows positions late, so a rollback within that many tokens finds them).
    const int64_t first_read = p.kind == CacheKind::window ? std::max<int64_t>(0, new_length - window_) : 0;
    DSV4_CHECK(first_read >= t.first_logical_page * rpp, "kv_cache: rollback: sequence ", id, " to length ",
               new_length, ": its rows before ", t.first_logical_page * rpp, " of pool '", p.pages.name(),
               "' have left the window (rollback_rows ", options_.rollback_rows, ")");
    const int64_t keep = std::min<int64_t>(static_cast<int64_t>(t.pages.size()),
                                           std::max<int64_t>(0, ceil_div(rows_at(p, new_length), rpp) - t.first_logical_page));
    for (size_t k = static_cast<size_t>(keep); k < t.pages.size(); ++k) pools_[i].pages.release(t.pages[k]);
    if (static_cast<size_t>(keep) < t.pages.size()) table_changed(i, s);
    t.pages.resize(static_cast<size_t>(keep));
  }
  s.length = new_length;
}

// ----- rows

void KvCacheManager::write_rows(SequenceId id, CacheKind kind, int layer, int64_t first_row,
                                int64_t n, const float* x) {
  const int index = pool_index(kind, layer);
  CachePool& p = pools_[index];
  Sequence& s = sequence("write_rows", id);
  BlockTable& t = s.tables[index];
  const int64_t committed = rows_at(p, s.length);
  DSV4_CHECK(n >= 0 && first_row >= committed && first_row <= kInt64Max - n,
             "kv_cache: write_rows: ", row_name(p, id, first_row), " + ", n,
             " rows: expected n >= 0 and rows from ", committed, " (committed rows are immutable)");
  if (n == 0) return;
  DSV4_CHECK(first_row + n <= held_rows(p, t), "kv_cache: write_rows: ",
             row_name(p, id, first_row + n - 1), " is not reserved (pages cover rows below ",
             held_rows(p, t), "; reserve the step first)");
  // Pages still shared here were shared after the step was reserved (a fork in between): copy
  // them now, all allocated at once so that a shortage changes nothing.
  const int64_t rpp = p.pages.rows_per_page();
  std::vector<size_t> shared;
  for (int64_t lp = first_row / rpp; lp <= (first_row + n - 1) / rpp; ++lp) {
    const size_t k = static_cast<size_t>(lp - t.first_logical_page);
    if (p.pages.refcount(t.pages[k]) > 1) shared.push_back(k);
  }
  if (static_cast<int64_t>(shared.size()) > p.pages.free_pages())
    throw Error(p.pages.exhausted_message(static_cast<int64_t>(shared.size())) +
                " (copy-on-write for " + row_name(p, id, first_row) + ")");
  const std::vector<int64_t> fresh = p.pages.allocate(static_cast<int64_t>(shared.size()));
  for (size_t c = 0; c < shared.size(); ++c) {
    p.pages.copy_page(t.pages[shared[c]], fresh[c]);
    p.pages.release(t.pages[shared[c]]);
    t.pages[shared[c]] = fresh[c];
  }
  if (!shared.empty()) table_changed(static_cast<size_t>(index), s);
  std::vector<int64_t> slots(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) slots[r] = checked_slot(index, id, s, first_row + r);
  p.pages.write_rows(x, n, slots.data());
}

void KvCacheManager::read_rows(SequenceId id, CacheKind kind, int layer, int64_t first_row,
                               int64_t n, float* out) const {
  const int index = pool_index(kind, layer);
  const CachePool& p = pools_[index];
  const Sequence& s = sequence("read_rows", id);
  DSV4_CHECK(n >= 0 && first_row <= kInt64Max - n, "kv_cache: read_rows: ",
             row_name(p, id, first_row), " + ", n, " rows: expected n >= 0");
  std::vector<int64_t> slots;
  for (int64_t r = first_row; r - first_row < n; ++r) {
    slots.push_back(checked_slot(index, id, s, r));
    DSV4_CHECK(p.pages.is_written(slots.back()), "kv_cache: read_rows: ", row_name(p, id, r),
               " has not been written");
  }
  p.pages.read_rows(slots.data(), n, out);
}

void KvCacheManager::write_slots(CacheKind kind, int layer, const int64_t* slots, int64_t n,
                                 const float* x) {
  pools_[pool_index(kind, layer)].pages.write_rows(x, n, slots);
}

void KvCacheManager::read_slots(CacheKind kind, int layer, const int64_t* slots, int64_t n,
                                float* out) const {
  pools_[pool_index(kind, layer)].pages.read_rows(slots, n, out);
}

// ----- compressor state

int64_t KvCacheManager::compressor_state_floats(int layer) const {
  DSV4_CHECK(layer >= 0 && layer < static_cast<int>(state_slabs_.size()), "kv_cache: layer ", layer,
             " is out of range [0, ", state_slabs_.size(), ")");
  return options_.compressor_state_floats[layer];
}

void KvCacheManager::check_host_state(const char* operation) const {
  DSV4_CHECK(options_.host_storage, "kv_cache: ", operation,
             ": the manager keeps no host compressor state (host_storage is off)");
}

int64_t KvCacheManager::state_offset(SequenceId id, int layer) const {
  const int64_t n = compressor_state_floats(layer);
  DSV4_CHECK(n > 0, "kv_cache: compressor_state: layer ", layer, " keeps no compressor state");
  check_host_state("compressor_state");
  return sequence("compressor_state", id).slot * n;
}

std::span<float> KvCacheManager::compressor_state(SequenceId id, int layer) {
  const int64_t offset = state_offset(id, layer);  // checks the layer before it indexes
  return std::span<float>(state_slabs_[layer]).subspan(offset, compressor_state_floats(layer));
}

std::span<const float> KvCacheManager::compressor_state(SequenceId id, int layer) const {
  const int64_t offset = state_offset(id, layer);
  return std::span<const float>(state_slabs_[layer]).subspan(offset, compressor_state_floats(layer));
}

int64_t KvCacheManager::sequence_slot(SequenceId id) const { return sequence("sequence_slot", id).slot; }

std::span<const float> KvCacheManager::compressor_state_slab(int layer) const {
  compressor_state_floats(layer);  // range check
  check_host_state("compressor_state_slab");
  return state_slabs_[layer];
}

}  // namespace dsv4
