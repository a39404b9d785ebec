// Unit tests of the page pools and the paged KV-cache manager (include/dsv4/kv_cache.h).
// The model is the tiny-v4.1 preset: window 16, layers 0 (window only), 1-3 (ratio 2, kv source 1),
// 4-7 (ratio 1, kv source 4), 8 (MTP, window only); head 512, index head 128.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/error.h"
#include "dsv4/kv_cache.h"
#include "dsv4/kv_format.h"

namespace dsv4 {
namespace {

using Rows = std::vector<float>;  // row-major [n, dims]

Rows random_rows(std::mt19937& rng, int64_t n, int64_t dims, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  Rows x(static_cast<size_t>(n * dims));
  for (float& v : x) v = dist(rng);
  return x;
}

// Runs fn and checks that it throws dsv4::Error with exactly `message`.
void expect_error(const std::function<void()>& fn, const std::string& message) {
  try {
    fn();
    ADD_FAILURE() << "no error, expected: " << message;
  } catch (const Error& e) {
    EXPECT_EQ(e.what(), message);
  }
}

// Runs fn and checks that it throws dsv4::Error whose message contains `part`.
void expect_error_containing(const std::function<void()>& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error, expected one containing: " << part;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Tiny {
  ModelConfig config = preset_config("tiny-v4.1");
  ModelTopology topology = resolve_topology(config);
};

// Float storage, small pages: 4 window rows, 4 compressed entries, 2 index keys per page.
KvCacheOptions float_options(int64_t window_pages, int64_t compressed_pages, int64_t index_pages,
                             int64_t max_sequences = 8) {
  KvCacheOptions o;
  o.capacity = {max_sequences, window_pages, compressed_pages, index_pages};
  o.window_rows_per_page = 4;
  o.compressed_rows_per_page = 4;
  o.index_key_rows_per_page = 2;
  return o;
}

// Every pool's stats, reference counts and every block table, flattened for equality checks.
std::vector<int64_t> snapshot(const KvCacheManager& m, const Tiny& t) {
  std::vector<int64_t> s;
  for (const PagePool* p : m.pools()) {
    const PoolStats st = p->stats();
    s.insert(s.end(), {st.free_pages, st.used_pages, st.shared_pages});
    for (int64_t page = 0; page < p->num_pages(); ++page) s.push_back(p->refcount(page));
  }
  for (const SequenceId id : m.sequences()) {
    s.push_back(m.sequence_length(id));
    for (int l = 0; l < t.topology.size(); ++l) {
      for (CacheKind k : {CacheKind::window, CacheKind::compressed, CacheKind::index_keys}) {
        if (!m.has_pool(k, l)) continue;
        const BlockTableView bt = m.block_table(id, k, l);
        s.push_back(bt.first_logical_page);
        s.insert(s.end(), bt.pages.begin(), bt.pages.end());
        s.push_back(-1);
      }
    }
  }
  return s;
}

// What a test wrote into one sequence: rows per (kind, layer), indexed by row.
struct Written {
  std::map<std::pair<CacheKind, int>, std::vector<Rows>> rows;
  Rows row(CacheKind k, int layer, int64_t first, int64_t n) const {
    Rows out;
    const auto& v = rows.at({k, layer});
    for (int64_t r = first; r < first + n; ++r) out.insert(out.end(), v.at(r).begin(), v.at(r).end());
    return out;
  }
};

// One step of `n` tokens for one sequence: reserve, write every row of every pool (window rows
// with write_rows, compressed / index-key entries with step_slots + write_slots as a kernel
// does), commit.
void extend(KvCacheManager& m, const Tiny& t, SequenceId id, int64_t n, std::mt19937& rng,
            Written& w) {
  const std::vector<CacheStepEntry> step = {{id, n}};
  m.reserve(step);
  const int64_t length = m.sequence_length(id);
  for (int l = 0; l < t.topology.size(); ++l) {
    const int64_t dims = m.pool(CacheKind::window, l).dims();
    const Rows x = random_rows(rng, n, dims);
    m.write_rows(id, CacheKind::window, l, length, n, x.data());
    auto& rows = w.rows[{CacheKind::window, l}];
    rows.resize(length + n);
    for (int64_t i = 0; i < n; ++i) rows[length + i].assign(x.begin() + i * dims, x.begin() + (i + 1) * dims);
    const LayerStepSlots slots = m.step_slots(step, l);
    for (CacheKind k : {CacheKind::compressed, CacheKind::index_keys}) {
      if (!m.has_pool(k, l)) continue;
      const int64_t kdims = m.pool(k, l).dims(), ratio = m.tokens_per_row(k, l);
      const Rows y = random_rows(rng, n, kdims);
      const auto& s = k == CacheKind::compressed ? slots.compressed : slots.index_keys;
      m.write_slots(k, l, s.data(), n, y.data());
      auto& entries = w.rows[{k, l}];
      for (int64_t i = 0; i < n; ++i) {
        if ((length + i + 1) % ratio != 0) continue;
        entries.resize((length + i + 1) / ratio);
        entries.back().assign(y.begin() + i * kdims, y.begin() + (i + 1) * kdims);
      }
    }
  }
  m.commit(id, length + n);
}

// Reads every readable row of every pool of `id` and compares it with what was written.
void expect_contents(const KvCacheManager& m, const Tiny& t, SequenceId id, const Written& w) {
  const int64_t length = m.sequence_length(id);
  for (int l = 0; l < t.topology.size(); ++l) {
    for (CacheKind k : {CacheKind::window, CacheKind::compressed, CacheKind::index_keys}) {
      if (!m.has_pool(k, l)) continue;
      const int64_t first = m.first_readable_row(id, k, l);
      const int64_t end = length / m.tokens_per_row(k, l);
      Rows out(static_cast<size_t>((end - first) * m.pool(k, l).dims()));
      m.read_rows(id, k, l, first, end - first, out.data());
      EXPECT_EQ(out, w.row(k, l, first, end - first))
          << "sequence " << id << " layer " << l << " " << cache_kind_name(k);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// PagePool

PoolSpec float_spec(const std::string& name, int64_t pages, int64_t rows_per_page = 4, int64_t dims = 8) {
  PoolSpec s;
  s.name = name;
  s.dims = dims;
  s.rows_per_page = rows_per_page;
  s.num_pages = pages;
  return s;
}

TEST(PagePool, AllocatesLowestIdsFirstAndCountsReferences) {
  PagePool pool(float_spec("test", 6));
  EXPECT_EQ(pool.allocate(2), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(pool.allocate(1), (std::vector<int64_t>{2}));
  pool.retain(1);
  pool.retain(1);
  EXPECT_EQ(pool.refcount(1), 3);
  PoolStats s = pool.stats();
  EXPECT_EQ(s.total_pages, 6);
  EXPECT_EQ(s.free_pages, 3);
  EXPECT_EQ(s.used_pages, 3);
  EXPECT_EQ(s.shared_pages, 1);
  EXPECT_EQ(s.page_bytes, 4 * 8 * 4);
  pool.release(0);
  pool.release(1);
  EXPECT_EQ(pool.refcount(0), 0);
  EXPECT_EQ(pool.refcount(1), 2);
  EXPECT_EQ(pool.free_pages(), 4);
  // A released page is handed out again before the untouched ones.
  EXPECT_EQ(pool.allocate(1), (std::vector<int64_t>{0}));
  expect_error([&] { pool.release(5); }, "dsv4: kv_cache: release in pool 'test': page 5 is already free");
  expect_error([&] { pool.retain(4); }, "dsv4: kv_cache: retain in pool 'test': page 4 is free");
  expect_error([&] { pool.release(6); },
               "dsv4: kv_cache: release in pool 'test': page 6 is out of range [0, 6)");
  expect_error([&] { pool.allocate(-1); },
               "dsv4: kv_cache: allocate in pool 'test': asked for -1 pages, expected >= 0");
}

TEST(PagePool, ExhaustionIsAllOrNothingWithExactMessage) {
  PagePool pool(float_spec("layer 20 compressed (v41_fp4)", 4096));
  pool.allocate(4095);
  expect_error([&] { pool.allocate(3); },
               "dsv4: kv_cache: pool 'layer 20 compressed (v41_fp4)' is exhausted: asked for 3 pages, "
               "1 free of 4096");
  EXPECT_EQ(pool.free_pages(), 1);
  EXPECT_EQ(pool.allocate(1), (std::vector<int64_t>{4095}));
  expect_error([&] { pool.allocate(1); },
               "dsv4: kv_cache: pool 'layer 20 compressed (v41_fp4)' is exhausted: asked for 1 page, "
               "0 free of 4096");
}

TEST(PagePool, FloatRowsRoundTripAtTheirByteOffsets) {
  std::mt19937 rng(11);
  PagePool pool(float_spec("float", 3, 4, 8));
  EXPECT_TRUE(pool.float_storage());
  expect_error_containing([&] { pool.geometry(); }, "stores fp32 rows");
  pool.allocate(3);
  const std::vector<int64_t> slots = {5, -1, 0, 11, 7};
  const Rows x = random_rows(rng, 5, 8);
  pool.write_rows(x.data(), 5, slots.data());
  // Row `slot` lives at page * stride + row * dims * 4: what a device mirror relies on.
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0) continue;
    float stored[8];
    const int64_t offset = pool.page_offset(slots[i] / 4) + (slots[i] % 4) * 8 * 4;
    std::memcpy(stored, pool.bytes().data() + offset, sizeof(stored));
    EXPECT_TRUE(std::equal(stored, stored + 8, x.begin() + i * 8)) << "slot " << slots[i];
  }
  EXPECT_FALSE(pool.is_written(1));
  const std::vector<int64_t> back = {0, 5, 11};
  Rows out(3 * 8);
  pool.read_rows(back.data(), 3, out.data());
  EXPECT_TRUE(std::equal(out.begin(), out.begin() + 8, x.begin() + 2 * 8));
  EXPECT_TRUE(std::equal(out.begin() + 8, out.begin() + 16, x.begin()));
  EXPECT_TRUE(std::equal(out.begin() + 16, out.end(), x.begin() + 3 * 8));
}

TEST(PagePool, RejectsWritesToSharedOrFreePagesAndReadsOfUnwrittenRows) {
  std::mt19937 rng(12);
  PagePool pool(float_spec("p", 3, 4, 8));
  pool.allocate(2);
  pool.retain(1);
  const Rows x = random_rows(rng, 2, 8);
  const int64_t to_shared[2] = {0, 5};
  expect_error([&] { pool.write_rows(x.data(), 2, to_shared); },
               "dsv4: kv_cache: write_rows in pool 'p': slot 5 is on page 1 with reference count 2, "
               "expected 1 (a free page is not writable, a shared one must be copied first)");
  EXPECT_FALSE(pool.is_written(0));  // all slots are checked before anything is written
  const int64_t to_free[1] = {9};
  expect_error_containing([&] { pool.write_rows(x.data(), 1, to_free); }, "with reference count 0");
  const int64_t unwritten[1] = {2};
  float out[8];
  expect_error([&] { pool.read_rows(unwritten, 1, out); },
               "dsv4: kv_cache: read_rows in pool 'p': slot 2 (page 0, row 2) has not been written");
  const int64_t outside[1] = {12};
  expect_error([&] { pool.read_rows(outside, 1, out); },
               "dsv4: kv_cache: read_rows in pool 'p': slot 12 is out of range [0, 12)");
}

TEST(PagePool, CopyPageCopiesBytesAndWrittenRows) {
  std::mt19937 rng(13);
  PagePool pool(float_spec("p", 2, 4, 8));
  pool.allocate(2);
  const Rows x = random_rows(rng, 2, 8);
  const int64_t slots[2] = {1, 3};
  pool.write_rows(x.data(), 2, slots);
  pool.copy_page(0, 1);
  EXPECT_TRUE(std::equal(pool.bytes().begin(), pool.bytes().begin() + pool.page_stride(),
                         pool.bytes().begin() + pool.page_stride()));
  EXPECT_TRUE(pool.is_written(5));
  EXPECT_FALSE(pool.is_written(4));
  const int64_t copied[2] = {5, 7};
  Rows out(2 * 8);
  pool.read_rows(copied, 2, out.data());
  EXPECT_EQ(out, x);
}

// ---------------------------------------------------------------------------------------------
// KvCacheManager

TEST(KvCacheManager, CreatesPoolsFromTheTopology) {
  Tiny t;
  KvCacheManager m(t.config, t.topology, float_options(10, 5, 7));
  for (const LayerPlan& plan : t.topology.layers) {
    const int l = plan.layer;
    EXPECT_TRUE(m.has_pool(CacheKind::window, l));
    EXPECT_EQ(m.pool(CacheKind::window, l).name(), "layer " + std::to_string(l) + " window (f32)");
    EXPECT_EQ(m.pool(CacheKind::window, l).num_pages(), 10);
    EXPECT_EQ(m.pool(CacheKind::window, l).dims(), t.config.head_dim);
    EXPECT_EQ(m.has_pool(CacheKind::compressed, l), plan.owns_compressor);
    EXPECT_EQ(m.has_pool(CacheKind::index_keys, l), plan.owns_index_keys);
    if (plan.owns_compressor) {
      EXPECT_EQ(m.tokens_per_row(CacheKind::compressed, l), plan.compress_ratio);
      EXPECT_EQ(m.pool(CacheKind::compressed, l).num_pages(), 5);
      EXPECT_EQ(m.pool(CacheKind::index_keys, l).dims(), t.config.index_head_dim);
      EXPECT_EQ(m.pool(CacheKind::index_keys, l).num_pages(), 7);
    }
  }
  EXPECT_TRUE(m.has_pool(CacheKind::compressed, 1) && m.has_pool(CacheKind::compressed, 4));
  EXPECT_EQ(m.pools().size(), static_cast<size_t>(t.topology.size() + 4));
  expect_error([&] { m.pool(CacheKind::compressed, 2); },
               "dsv4: kv_cache: layer 2 has no compressed cache (only kv-source layers own compressed "
               "and index-key caches)");
  expect_error([&] { m.pool(CacheKind::window, 9); }, "dsv4: kv_cache: layer 9 is out of range [0, 9)");
}

TEST(KvCacheManager, WindowTrimsWholePagesAtExactBoundaries) {
  Tiny t;
  const int64_t window = t.config.sliding_window, rpp = 4;
  ASSERT_EQ(window, 16);
  KvCacheManager m(t.config, t.topology, float_options(40, 40, 80));
  std::mt19937 rng(21);
  Written w;
  m.add_sequence(1);
  // Lengths visited: 1 2 5 8 12 16 17 20 24 25 28 32 48 49 52 100 117 119: page edges, the window
  // edge (16, 17, 20: page 0 leaves exactly when position 4 is the first kept one), chunks longer
  // than the window.
  for (const int64_t n : {1, 1, 3, 3, 4, 4, 1, 3, 4, 1, 3, 4, 16, 1, 3, 48, 17, 2}) {
    extend(m, t, 1, n, rng, w);
    const int64_t length = m.sequence_length(1);
    const int64_t keep = std::max<int64_t>(0, length - window);
    for (int l = 0; l < t.topology.size(); ++l) {
      const BlockTableView bt = m.block_table(1, CacheKind::window, l);
      EXPECT_EQ(bt.first_logical_page, keep / rpp) << "length " << length;
      EXPECT_EQ(static_cast<int64_t>(bt.pages.size()), ceil_div(length, rpp) - keep / rpp) << "length " << length;
      const PagePool& pool = m.pool(CacheKind::window, l);
      EXPECT_EQ(pool.free_pages(), pool.num_pages() - static_cast<int64_t>(bt.pages.size()));
    }
    EXPECT_EQ(m.first_readable_row(1, CacheKind::window, 0), keep);
    expect_contents(m, t, 1, w);
    if (keep > 0) {
      float row[512];
      expect_error_containing([&] { m.read_rows(1, CacheKind::window, 0, keep - 1, 1, row); },
                              "has left the window");
    }
  }
  EXPECT_EQ(m.sequence_length(1), 119);
  float row[512];
  expect_error([&] { m.read_rows(1, CacheKind::window, 3, 102, 1, row); },
               "dsv4: kv_cache: sequence 1 layer 3 window position 102 has left the window (rows "
               "from 103 are kept at length 119)");
  expect_error([&] { m.slot(1, CacheKind::window, 3, 120); },
               "dsv4: kv_cache: sequence 1 layer 3 window position 120 is not reserved (pages cover "
               "rows below 120; reserve the step first)");
}

TEST(KvCacheManager, CompressedEntriesCloseAtAndInsideChunks) {
  Tiny t;
  KvCacheManager m(t.config, t.topology, float_options(40, 40, 80));
  std::mt19937 rng(31);
  Written w;
  m.add_sequence(5);
  // Ratio 2 (layer 1): a 3-token chunk closes group 0 inside it and leaves a partial group, the
  // next single token closes group 1 at the chunk's first token, odd/even chunks alternate.
  for (const int64_t n : {3, 1, 1, 4, 2, 5, 7, 1}) {
    const int64_t length = m.sequence_length(5);
    const std::vector<CacheStepEntry> step = {{5, n}};
    m.reserve(step);
    for (const int layer : {1, 4}) {
      const int64_t ratio = layer == 1 ? 2 : 1;
      const LayerStepSlots slots = m.step_slots(step, layer);
      ASSERT_EQ(slots.window.size(), static_cast<size_t>(n));
      ASSERT_EQ(slots.compressed.size(), static_cast<size_t>(n));
      ASSERT_EQ(slots.index_keys.size(), static_cast<size_t>(n));
      int64_t closing = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = length + i;
        const BlockTableView wt = m.block_table(5, CacheKind::window, layer);
        EXPECT_EQ(slots.window[i], wt.pages[p / 4 - wt.first_logical_page] * 4 + p % 4);
        if ((p + 1) % ratio != 0) {
          EXPECT_EQ(slots.compressed[i], -1) << "position " << p;
          EXPECT_EQ(slots.index_keys[i], -1) << "position " << p;
          continue;
        }
        ++closing;
        const int64_t j = (p + 1) / ratio - 1;
        const BlockTableView ct = m.block_table(5, CacheKind::compressed, layer);
        const BlockTableView it = m.block_table(5, CacheKind::index_keys, layer);
        EXPECT_EQ(ct.first_logical_page, 0);
        EXPECT_EQ(slots.compressed[i], ct.pages[j / 4] * 4 + j % 4) << "entry " << j;
        EXPECT_EQ(slots.index_keys[i], it.pages[j / 2] * 2 + j % 2) << "entry " << j;
      }
      EXPECT_EQ(closing, (length + n) / ratio - length / ratio);
      EXPECT_EQ(m.held_rows(5, CacheKind::compressed, layer), ceil_div((length + n) / ratio, 4) * 4);
    }
    // The slots stay valid for a second reserve of the same step: it allocates nothing.
    const std::vector<int64_t> before = snapshot(m, t);
    m.reserve(step);
    EXPECT_EQ(snapshot(m, t), before);
    if ((length + n) / 2 > length / 2) {
      float row[512];
      expect_error([&] { m.read_rows(5, CacheKind::compressed, 1, (length + n) / 2 - 1, 1, row); },
                   "dsv4: kv_cache: read_rows: sequence 5 layer 1 compressed entry " +
                       std::to_string((length + n) / 2 - 1) + " has not been written");
    }
    m.commit(5, length);  // nothing written yet: stay, then run the step for real
    extend(m, t, 5, n, rng, w);
    expect_contents(m, t, 5, w);
  }
  EXPECT_EQ(m.sequence_length(5), 24);
  float row[512];
  expect_error([&] { m.read_rows(5, CacheKind::compressed, 1, 12, 1, row); },
               "dsv4: kv_cache: sequence 5 layer 1 compressed entry 12 is not reserved (pages cover "
               "rows below 12; reserve the step first)");
  expect_error([&] { m.read_rows(5, CacheKind::compressed, 4, -1, 1, row); },
               "dsv4: kv_cache: sequence 5 layer 4 compressed entry -1 does not exist (rows from 0 "
               "are kept at length 24)");
}

TEST(KvCacheManager, ReserveIsAllOrNothingAcrossSequencesAndPools) {
  Tiny t;
  KvCacheManager m(t.config, t.topology, float_options(8, 3, 10));
  std::mt19937 rng(41);
  Written w1;
  m.add_sequence(1);
  extend(m, t, 1, 6, rng, w1);
  m.add_sequence(2);
  const std::vector<int64_t> before = snapshot(m, t);
  // Sequence 1 (length 6) + 10 and sequence 2 (length 0) + 2. Window pools: 2 + 1 pages of 6 free.
  // Layer 1 compressed (ratio 2): entries 3..7 need 1 page more, entry 0 one page: 2 of 2 free.
  // Layer 4 compressed (ratio 1): entries 6..15 need 2 pages more, entries 0..1 one: 3, 1 free.
  expect_error([&] { m.reserve({{1, 10}, {2, 2}}); },
               "dsv4: kv_cache: pool 'layer 4 compressed (f32)' is exhausted: asked for 3 pages, 1 "
               "free of 3 (reserving sequence 1: 10 tokens at length 6, sequence 2: 2 tokens at "
               "length 0)");
  EXPECT_EQ(snapshot(m, t), before);
  // A single absurd request fails on the count, without building anything.
  expect_error_containing([&] { m.reserve({{2, int64_t{1} << 60}}); }, "is exhausted");
  EXPECT_EQ(snapshot(m, t), before);
  // Invalid steps change nothing either.
  expect_error([&] { m.reserve({{1, 1}, {1, 2}}); },
               "dsv4: kv_cache: reserve: sequence 1 appears twice in the step");
  expect_error([&] { m.reserve({{2, 1}, {3, 1}}); }, "dsv4: kv_cache: reserve: sequence 3 does not exist");
  expect_error([&] { m.reserve({{2, 0}}); },
               "dsv4: kv_cache: reserve: sequence 2 asks for 0 new tokens, expected > 0");
  EXPECT_EQ(snapshot(m, t), before);
  // What fits still runs.
  Written w2;
  extend(m, t, 2, 2, rng, w2);
  extend(m, t, 1, 2, rng, w1);
  expect_contents(m, t, 1, w1);
  expect_contents(m, t, 2, w2);
}

TEST(KvCacheManager, ForkSharesPagesAndCopiesOnWrite) {
  Tiny t;
  KvCacheOptions o = float_options(40, 40, 80);
  o.compressor_state_floats.assign(t.topology.size(), 0);
  o.compressor_state_floats[1] = 6;
  KvCacheManager m(t.config, t.topology, o);
  std::mt19937 rng(51);
  Written parent;
  m.add_sequence(1);
  extend(m, t, 1, 10, rng, parent);
  std::vector<int64_t> parent_pages;  // window pages of layer 0: rows 0-3, 4-7, 8-9 (partial)
  for (int64_t p : m.block_table(1, CacheKind::window, 0).pages) parent_pages.push_back(p);
  ASSERT_EQ(parent_pages.size(), 3u);
  const Rows state = random_rows(rng, 1, 6);
  std::copy(state.begin(), state.end(), m.compressor_state(1, 1).begin());

  m.fork_sequence(1, 2);
  EXPECT_EQ(m.sequence_length(2), 10);
  for (const PagePool* pool : m.pools()) {
    const PoolStats s = pool->stats();
    EXPECT_EQ(s.shared_pages, s.used_pages) << pool->name();
  }
  for (int l = 0; l < t.topology.size(); ++l) {
    const BlockTableView a = m.block_table(1, CacheKind::window, l), b = m.block_table(2, CacheKind::window, l);
    EXPECT_TRUE(std::equal(a.pages.begin(), a.pages.end(), b.pages.begin(), b.pages.end()));
  }
  EXPECT_EQ(m.sequence_bytes(2), m.sequence_bytes(1));
  EXPECT_TRUE(std::equal(state.begin(), state.end(), m.compressor_state(2, 1).begin()));
  expect_contents(m, t, 2, parent);

  // Snapshot the parent's bytes, then let the child write 3 tokens into the shared tail pages.
  std::map<std::pair<CacheKind, int>, std::vector<std::byte>> parent_bytes;
  for (int l = 0; l < t.topology.size(); ++l) {
    for (CacheKind k : {CacheKind::window, CacheKind::compressed, CacheKind::index_keys}) {
      if (m.has_pool(k, l)) parent_bytes[{k, l}].assign(m.pool(k, l).bytes().begin(), m.pool(k, l).bytes().end());
    }
  }
  const int64_t free_before = m.pool(CacheKind::window, 0).free_pages();
  Written child = parent;
  extend(m, t, 2, 3, rng, child);
  // Layer 0 window: the shared tail page 8-11 is copied, page 12-15 is new.
  EXPECT_EQ(m.pool(CacheKind::window, 0).free_pages(), free_before - 2);
  const BlockTableView cw = m.block_table(2, CacheKind::window, 0);
  ASSERT_EQ(cw.pages.size(), 4u);
  EXPECT_EQ(cw.pages[0], parent_pages[0]);
  EXPECT_EQ(cw.pages[1], parent_pages[1]);
  EXPECT_NE(cw.pages[2], parent_pages[2]);
  EXPECT_EQ(m.pool(CacheKind::window, 0).refcount(parent_pages[2]), 1);
  EXPECT_EQ(m.pool(CacheKind::window, 0).refcount(parent_pages[0]), 2);
  // Ratio 2: group 5 closes at position 11 in the shared compressed page of entries 4-7.
  EXPECT_NE(m.block_table(2, CacheKind::compressed, 1).pages[1], m.block_table(1, CacheKind::compressed, 1).pages[1]);
  // Every byte of every page the parent holds is as before.
  for (const auto& [key, before] : parent_bytes) {
    const PagePool& pool = m.pool(key.first, key.second);
    for (const int64_t page : m.block_table(1, key.first, key.second).pages) {
      const auto begin = pool.page_offset(page), end = begin + pool.page_stride();
      EXPECT_TRUE(std::equal(pool.bytes().begin() + begin, pool.bytes().begin() + end, before.begin() + begin))
          << pool.name() << " page " << page;
    }
  }
  expect_contents(m, t, 1, parent);
  expect_contents(m, t, 2, child);
  float row[512];
  // The parent kept the original tail page, where it never wrote position 10.
  expect_error([&] { m.read_rows(1, CacheKind::window, 0, 10, 1, row); },
               "dsv4: kv_cache: read_rows: sequence 1 layer 0 window position 10 has not been written");

  // The parent now holds its tail page alone: extending in place allocates nothing in layer 0.
  const int64_t free_now = m.pool(CacheKind::window, 0).free_pages();
  extend(m, t, 1, 2, rng, parent);
  EXPECT_EQ(m.pool(CacheKind::window, 0).free_pages(), free_now);
  expect_contents(m, t, 1, parent);
  expect_contents(m, t, 2, child);

  // Compressor state: the child's copy is its own.
  m.compressor_state(2, 1)[0] += 1.0f;
  EXPECT_EQ(m.compressor_state(1, 1)[0], state[0]);
}

TEST(KvCacheManager, OneCopyWhenEveryHolderOfASharedPageWritesInOneStep) {
  Tiny t;
  KvCacheManager m(t.config, t.topology, float_options(40, 40, 80));
  std::mt19937 rng(52);
  Written unchecked;
  m.add_sequence(1);
  extend(m, t, 1, 10, rng, unchecked);
  m.fork_sequence(1, 2);
  const int64_t free_before = m.pool(CacheKind::window, 0).free_pages();
  const int64_t shared_window_tail = m.block_table(1, CacheKind::window, 0).pages[2];
  const int64_t shared_entry_page = m.block_table(1, CacheKind::compressed, 4).pages[2];
  const std::vector<PageCopy> copies = m.reserve({{1, 1}, {2, 1}});
  // Sequence 1 copies the shared tail page; sequence 2, then its only holder, writes in place.
  EXPECT_EQ(m.pool(CacheKind::window, 0).free_pages(), free_before - 1);
  EXPECT_EQ(m.block_table(2, CacheKind::window, 0).pages[2], shared_window_tail);
  EXPECT_NE(m.block_table(1, CacheKind::window, 0).pages[2], shared_window_tail);
  // The copies reported for a device mirror: the window tail of every layer and layer 4's entry
  // page of entries 8-11 (position 10 closes no ratio-2 group; index-key entry 10 starts a new page).
  ASSERT_EQ(copies.size(), static_cast<size_t>(t.topology.size() + 1));
  for (const PageCopy& c : copies) {
    const bool window = c.kind == CacheKind::window;
    EXPECT_TRUE(window || (c.kind == CacheKind::compressed && c.layer == 4));
    EXPECT_EQ(c.from, window ? shared_window_tail : shared_entry_page);  // pools allocate alike
    EXPECT_EQ(c.to, m.block_table(1, c.kind, c.layer).pages[2]);
    const PagePool& pool = m.pool(c.kind, c.layer);
    EXPECT_TRUE(std::equal(pool.bytes().begin() + pool.page_offset(c.from),
                           pool.bytes().begin() + pool.page_offset(c.from) + pool.page_stride(),
                           pool.bytes().begin() + pool.page_offset(c.to)));
  }
  // Still shared: exactly the pages both tables hold.
  for (int l = 0; l < t.topology.size(); ++l) {
    for (CacheKind k : {CacheKind::window, CacheKind::compressed, CacheKind::index_keys}) {
      if (!m.has_pool(k, l)) continue;
      const BlockTableView a = m.block_table(1, k, l), b = m.block_table(2, k, l);
      int64_t common = 0;
      for (const int64_t page : a.pages) common += std::count(b.pages.begin(), b.pages.end(), page);
      EXPECT_EQ(m.pool(k, l).stats().shared_pages, common) << m.pool(k, l).name();
    }
  }
}

TEST(KvCacheManager, BookkeepingWithoutHostStorage) {
  // What a device backend uses: pages, tables, sharing and copies, but no host bytes (pages or
  // compressor state).
  Tiny t;
  KvCacheOptions o;
  o.formats = kv_format_set("v4.1-native");
  o.capacity = {4, 16, 8, 8};
  o.host_storage = false;
  o.compressor_state_floats.assign(t.topology.size(), 0);
  o.compressor_state_floats[1] = 6;
  KvCacheManager m(t.config, t.topology, o);
  m.add_sequence(1);
  EXPECT_EQ(m.sequence_bytes(1), 6 * 4);  // the state is accounted where it lives
  EXPECT_EQ(m.compressor_state_floats(1), 6);
  expect_error([&] { m.compressor_state(1, 1); },
               "dsv4: kv_cache: compressor_state: the manager keeps no host compressor state (host_storage is off)");
  expect_error([&] { m.compressor_state_slab(1); },
               "dsv4: kv_cache: compressor_state_slab: the manager keeps no host compressor state (host_storage is "
               "off)");
  m.reserve({{1, 40}});
  m.commit(1, 40);
  m.fork_sequence(1, 2);
  const std::vector<PageCopy> copies = m.reserve({{2, 1}});
  EXPECT_FALSE(copies.empty());
  m.commit(2, 41);
  for (const PagePool* pool : m.pools()) {
    EXPECT_FALSE(pool->host_storage());
    EXPECT_TRUE(pool->bytes().empty()) << pool->name();
  }
  // The window of 40 tokens at 32 rows per page: positions 24-39 in pages 0 and 1.
  EXPECT_EQ(m.block_table(1, CacheKind::window, 0).pages.size(), 2u);
  EXPECT_GT(m.sequence_bytes(2), 0);
  const Rows x(512, 1.0f);
  const std::vector<CacheStepEntry> step = {{2, 1}};
  m.reserve(step);
  expect_error([&] { m.write_slots(CacheKind::window, 0, m.step_slots(step, 0).window.data(), 1, x.data()); },
               "dsv4: kv_cache: write_rows in pool 'layer 0 window (v41_fp8)': the pool keeps no host "
               "bytes (host_storage is off)");
  m.release_sequence(1);
  m.release_sequence(2);
  for (const PagePool* pool : m.pools()) EXPECT_EQ(pool->free_pages(), pool->num_pages()) << pool->name();
}

TEST(KvCacheManager, ForkAfterReserveCopiesAtTheWrite) {
  Tiny t;
  KvCacheManager m(t.config, t.topology, float_options(40, 40, 80));
  std::mt19937 rng(53);
  Written parent;
  m.add_sequence(1);
  extend(m, t, 1, 10, rng, parent);
  const std::vector<CacheStepEntry> step = {{1, 2}};
  m.reserve(step);
  m.fork_sequence(1, 2);  // shares the tail page the parent has reserved rows in
  expect_error_containing([&] { m.step_slots(step, 0); },
                          "dsv4: kv_cache: step_slots: sequence 1 layer 0 window position 10 is on page");
  const Rows x = random_rows(rng, 2, 512);
  const int64_t shared_page = m.block_table(1, CacheKind::window, 0).pages[2];
  m.write_rows(1, CacheKind::window, 0, 10, 2, x.data());
  EXPECT_NE(m.block_table(1, CacheKind::window, 0).pages[2], shared_page);
  EXPECT_EQ(m.block_table(2, CacheKind::window, 0).pages[2], shared_page);
  EXPECT_EQ(m.pool(CacheKind::window, 0).refcount(shared_page), 1);
  Rows out(2 * 512);
  m.read_rows(1, CacheKind::window, 0, 10, 2, out.data());
  EXPECT_EQ(out, x);
  expect_contents(m, t, 2, parent);
  // Reserving the step again copies the other pools' shared pages; then step_slots works.
  m.reserve(step);
  EXPECT_EQ(m.step_slots(step, 4).window.size(), 2u);
}

TEST(KvCacheManager, ReleaseReturnsEveryPage) {
  Tiny t;
  KvCacheOptions o = float_options(60, 30, 60, 4);
  o.compressor_state_floats.assign(t.topology.size(), 0);
  o.compressor_state_floats[1] = 4;
  KvCacheManager m(t.config, t.topology, o);
  std::mt19937 rng(61);
  Written unchecked;
  m.add_sequence(10);
  extend(m, t, 10, 9, rng, unchecked);
  m.fork_sequence(10, 11);
  extend(m, t, 11, 21, rng, unchecked);
  m.fork_sequence(11, 12);
  m.add_sequence(13);
  extend(m, t, 13, 3, rng, unchecked);
  expect_error([&] { m.add_sequence(14); },
               "dsv4: kv_cache: add_sequence: sequence 14: all 4 sequence slots are in use");
  EXPECT_EQ(m.sequence_bytes(12), m.sequence_bytes(11));
  for (const SequenceId id : {11, 10, 13, 12}) m.release_sequence(id);
  EXPECT_TRUE(m.sequences().empty());
  for (const PagePool* pool : m.pools()) {
    const PoolStats s = pool->stats();
    EXPECT_EQ(s.free_pages, s.total_pages) << pool->name();
    EXPECT_EQ(s.used_pages, 0) << pool->name();
  }
  for (SequenceId id = 20; id < 24; ++id) m.add_sequence(id);  // every slot is free again
  for (SequenceId id = 20; id < 24; ++id) {
    const auto s = m.compressor_state(id, 1);
    EXPECT_TRUE(std::all_of(s.begin(), s.end(), [](float v) { return v == 0.0f; }));
  }
  expect_error([&] { m.release_sequence(10); }, "dsv4: kv_cache: release_sequence: sequence 10 does not exist");
}

TEST(KvCacheManager, SequenceBytesCountHeldPagesAndState) {
  Tiny t;
  KvCacheOptions o = float_options(40, 40, 80);
  o.compressor_state_floats.assign(t.topology.size(), 0);
  o.compressor_state_floats[1] = 2048;
  KvCacheManager m(t.config, t.topology, o);
  std::mt19937 rng(62);
  Written w;
  m.add_sequence(3);
  EXPECT_EQ(m.sequence_bytes(3), 2048 * 4);
  extend(m, t, 3, 21, rng, w);
  // Window: positions 5..20 kept -> pages 4-7 .. 20-23 = 5 pages of 4 x 512 floats, 9 layers.
  // Layer 1: 10 entries -> 3 pages of 4 x 512 floats; 10 index keys -> 5 pages of 2 x 128 floats.
  // Layer 4: 21 entries -> 6 pages; 21 index keys -> 11 pages.
  const int64_t expected = 9 * 5 * 4 * 512 * 4 + (3 + 6) * 4 * 512 * 4 + (5 + 11) * 2 * 128 * 4 + 2048 * 4;
  EXPECT_EQ(m.sequence_bytes(3), expected);
}

TEST(KvCacheManager, RejectsInvalidRequests) {
  Tiny t;
  KvCacheManager m(t.config, t.topology, float_options(20, 20, 20, 2));
  std::mt19937 rng(71);
  Written w;
  m.add_sequence(1);
  extend(m, t, 1, 5, rng, w);
  expect_error([&] { m.add_sequence(1); }, "dsv4: kv_cache: add_sequence: sequence 1 already exists");
  expect_error([&] { m.fork_sequence(7, 2); }, "dsv4: kv_cache: fork_sequence: sequence 7 does not exist");
  expect_error([&] { m.fork_sequence(1, 1); }, "dsv4: kv_cache: fork_sequence: sequence 1 already exists");
  expect_error([&] { m.commit(1, 4); }, "dsv4: kv_cache: commit: sequence 1 new length 4 is below its length 5");
  expect_error([&] { m.commit(1, 9); },
               "dsv4: kv_cache: commit: sequence 1 to length 9 needs 9 rows in pool 'layer 0 window "
               "(f32)', but only 8 are reserved (reserve the step first)");
  const Rows x = random_rows(rng, 1, 512);
  expect_error([&] { m.write_rows(1, CacheKind::window, 0, 4, 1, x.data()); },
               "dsv4: kv_cache: write_rows: sequence 1 layer 0 window position 4 + 1 rows: expected n "
               ">= 0 and rows from 5 (committed rows are immutable)");
  expect_error([&] { m.write_rows(1, CacheKind::window, 0, 8, 1, x.data()); },
               "dsv4: kv_cache: write_rows: sequence 1 layer 0 window position 8 is not reserved "
               "(pages cover rows below 8; reserve the step first)");
  expect_error([&] { m.compressor_state(1, 1); },
               "dsv4: kv_cache: compressor_state: layer 1 keeps no compressor state");
  expect_error([&] { m.step_slots({{1, 4}}, 0); },
               "dsv4: kv_cache: sequence 1 layer 0 window position 8 is not reserved (pages cover "
               "rows below 8; reserve the step first)");

  KvCacheOptions bad = float_options(20, 20, 20);
  bad.compressor_state_floats.assign(t.topology.size(), 0);
  bad.compressor_state_floats[2] = 8;
  expect_error([&] { KvCacheManager(t.config, t.topology, bad); },
               "dsv4: kv_cache: compressor_state_floats[2] is 8, but layer 2 owns no compressor (expected 0)");
  bad.compressor_state_floats.resize(3);
  expect_error([&] { KvCacheManager(t.config, t.topology, bad); },
               "dsv4: kv_cache: compressor_state_floats has 3 entries, expected 9 (one per layer) or none");
  expect_error([&] { KvCacheManager(t.config, t.topology, float_options(20, 20, 20, 0)); },
               "dsv4: kv_cache: capacity.max_sequences is 0, expected in [1, 1048576]");
  ModelTopology short_topology = t.topology;
  short_topology.layers.pop_back();
  expect_error([&] { KvCacheManager(t.config, short_topology, float_options(20, 20, 20)); },
               "dsv4: kv_cache: topology has 8 layers, expected 9 (config 'tiny-v4.1')");
}

TEST(KvCacheManager, PlannedCapacityFitsEverySequenceAtFullContext) {
  Tiny t;
  KvCacheOptions o = float_options(0, 0, 0);
  const int64_t sequences = 3, context = 61, step_tokens = 9;
  o.capacity = plan_kv_cache_capacity(t.config, t.topology, o, sequences, context, step_tokens);
  EXPECT_EQ(o.capacity.max_sequences, sequences);
  // Ratio 1 dominates: 61 entries in pages of 4 (16) or 2 (31), per sequence.
  EXPECT_EQ(o.capacity.compressed_pages, sequences * 16);
  EXPECT_EQ(o.capacity.index_key_pages, sequences * 31);
  KvCacheManager m(t.config, t.topology, o);
  std::mt19937 rng(81);
  std::vector<Written> w(sequences);
  for (SequenceId id = 0; id < sequences; ++id) m.add_sequence(id);
  // Random steps over all sequences, at most step_tokens tokens per step, until every one is full.
  std::uniform_int_distribution<int64_t> tokens(1, step_tokens);
  int64_t peak_window_pages = 0;
  while (true) {
    std::vector<CacheStepEntry> step;
    int64_t budget = step_tokens;
    for (SequenceId id = 0; id < sequences && budget > 0; ++id) {
      const int64_t n = std::min({tokens(rng), budget, context - m.sequence_length(id)});
      if (n > 0) step.push_back({id, n});
      budget -= n;
    }
    if (step.empty()) break;
    m.reserve(step);  // must never run out
    peak_window_pages = std::max(peak_window_pages, m.pool(CacheKind::window, 0).stats().used_pages);
    for (const auto& e : step) m.commit(e.sequence, m.sequence_length(e.sequence) + e.new_tokens);
  }
  EXPECT_LE(peak_window_pages, o.capacity.window_pages);
  EXPECT_GE(peak_window_pages, sequences * 16 / 4);  // at the end each holds a full window
  EXPECT_LE(o.capacity.window_pages, sequences * ceil_div(context, 4));
}

// Rows written through the manager in each format come back as decode(encode(x)) and sit at the
// byte offsets of the format's page geometry.
void expect_format_round_trip(const std::string& set_name, PagePlacement placement) {
  SCOPED_TRACE(set_name);
  Tiny t;
  KvCacheOptions o;
  o.formats = kv_format_set(set_name);
  o.capacity = {2, 4, 4, 4};
  o.placement = placement;
  o.fp8_tensor_scale = 0.75f;
  KvCacheManager m(t.config, t.topology, o);
  std::mt19937 rng(91);
  m.add_sequence(1);
  const int64_t n = 7;
  m.reserve({{1, n}});
  for (const auto& [kind, layer] : std::vector<std::pair<CacheKind, int>>{
           {CacheKind::window, 0}, {CacheKind::window, 8}, {CacheKind::compressed, 1},
           {CacheKind::compressed, 4}, {CacheKind::index_keys, 1}, {CacheKind::index_keys, 4}}) {
    const PagePool& pool = m.pool(kind, layer);
    const PageGeometry& g = pool.geometry();
    EXPECT_EQ(g.rows_per_page, default_rows_per_page(g.format));
    const int64_t rows = n / m.tokens_per_row(kind, layer), dims = pool.dims();
    // Rows with magnitudes spread over several binades, as after a norm with outliers.
    Rows x = random_rows(rng, rows, dims, 2.0f);
    for (int64_t r = 0; r < rows; ++r) x[r * dims + r] *= 40.0f;
    m.write_rows(1, kind, layer, 0, rows, x.data());
    // Independent reference: the same rows encoded at slots 0..rows-1 of a scratch arena.
    std::vector<std::byte> scratch(static_cast<size_t>(ceil_div(rows, g.rows_per_page) * g.page_stride));
    std::vector<int64_t> scratch_slots(rows);
    for (int64_t r = 0; r < rows; ++r) scratch_slots[r] = r;
    encode_rows(g, x.data(), rows, scratch_slots.data(), scratch.data(), 0.75f);
    Rows expected(x.size()), out(x.size());
    decode_rows(g, scratch.data(), scratch_slots.data(), rows, expected.data(), 0.75f);
    m.read_rows(1, kind, layer, 0, rows, out.data());
    EXPECT_EQ(out, expected) << pool.name();
    // f32 keeps the values themselves; every other format rounds some of them.
    if (g.format == KvRowFormat::f32) EXPECT_EQ(out, x) << pool.name() << ": f32 rows must be exact";
    else EXPECT_NE(out, x) << pool.name() << ": a quantizing format should change some value";
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t slot = m.slot(1, kind, layer, r);
      const auto* stored = pool.bytes().data() + pool.page_offset(slot / g.rows_per_page);
      const auto* ref = scratch.data() + (r / g.rows_per_page) * g.page_stride;
      const int64_t row = slot % g.rows_per_page, ref_row = r % g.rows_per_page;
      EXPECT_EQ(std::memcmp(stored + g.data_offset(row), ref + g.data_offset(ref_row), g.row.data_bytes), 0)
          << pool.name() << " row " << r;
      EXPECT_EQ(std::memcmp(stored + g.scale_offset(row), ref + g.scale_offset(ref_row), g.row.scale_bytes), 0)
          << pool.name() << " row " << r;
    }
  }
}

TEST(KvCacheManager, FormatRoundTripForEveryFormatSet) {
  for (const std::string& name : kv_format_set_names()) expect_format_round_trip(name, PagePlacement::segregated);
  expect_format_round_trip("v4.1-native", PagePlacement::interleaved);
}

}  // namespace
}  // namespace dsv4
