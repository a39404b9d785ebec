// Randomized stress test of KvCacheManager: thousands of add / extend (reserve + write + commit) /
// fork / release operations on many sequences of a small V4.1 topology with pools so small that
// they run out. After every operation the manager is checked against a plain model (a vector of
// rows per sequence and pool) and against global invariants: every page's reference count equals
// the number of block-table entries naming it, free + used = total, nothing leaks. Fixed seeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/error.h"
#include "dsv4/kv_cache.h"
#include "dsv4/kv_format.h"

namespace dsv4 {
namespace {

using Row = std::vector<float>;

struct PoolKey {
  CacheKind kind;
  int layer;
};

// What one sequence must contain.
struct SequenceModel {
  int64_t length = 0;
  std::vector<std::vector<Row>> rows;        // per pool key: row r (position or entry) -> values
  std::map<int, std::vector<float>> state;  // per layer with compressor state
};

struct StressSetup {
  std::string name;
  uint32_t seed;
  int operations;
  std::optional<std::string> format_set;  // nullopt: float storage with narrow rows
  int64_t window_rows_per_page, compressed_rows_per_page, index_key_rows_per_page;
};

class Stress {
 public:
  explicit Stress(const StressSetup& setup)
      : config_(make_config(setup)), topology_(resolve_topology(config_)),
        manager_(config_, topology_, make_options(setup, topology_)), rng_(setup.seed) {
    for (int l = 0; l < topology_.size(); ++l) {
      for (CacheKind k : {CacheKind::window, CacheKind::compressed, CacheKind::index_keys})
        if (manager_.has_pool(k, l)) keys_.push_back({k, l});
    }
  }

  void run(int operations) {
    for (int op = 0; op < operations; ++op) {
      SCOPED_TRACE("operation " + std::to_string(op));
      const int pick = std::uniform_int_distribution<int>(0, 99)(rng_);
      if (pick < 14) add();
      else if (pick < 62) extend();
      else if (pick < 74) fork();
      else if (pick < 80) fork_after_reserve();
      else release();
      verify();
      if (::testing::Test::HasFailure()) return;
    }
    std::cout << "[ counts   ]";
    for (const auto& [what, n] : counts_) std::cout << " " << what << ": " << n << ";";
    std::cout << "\n";
    // Enough of everything happened for the run to mean something.
    EXPECT_GT(counts_["extend"], operations / 5);
    EXPECT_GT(counts_["fork"], operations / 50);
    for (const char* rare : {"exhausted", "copy-on-write step", "slots full"}) EXPECT_GT(counts_[rare], 0) << rare;
    while (!model_.empty()) release();
    verify();
    for (const PagePool* p : manager_.pools()) EXPECT_EQ(p->free_pages(), p->num_pages()) << p->name();
  }

 private:
  static constexpr int64_t kMaxSequences = 6;

  static ModelConfig make_config(const StressSetup& setup) {
    ModelConfig c = preset_config("tiny-v4.1");  // window 16; ratio-2 source 1, ratio-1 source 4
    if (!setup.format_set) {
      // Float storage takes any width: narrow rows keep the checks cheap.
      c.head_dim = 32;
      c.rope_head_dim = 8;
      c.index_head_dim = 32;
    }
    return c;
  }

  static KvCacheOptions make_options(const StressSetup& setup, const ModelTopology& topology) {
    KvCacheOptions o;
    if (setup.format_set) o.formats = kv_format_set(*setup.format_set);
    o.window_rows_per_page = setup.window_rows_per_page;
    o.compressed_rows_per_page = setup.compressed_rows_per_page;
    o.index_key_rows_per_page = setup.index_key_rows_per_page;
    // Room for a full window per sequence plus a little: long chunks and many sequences run out.
    const int64_t w = setup.window_rows_per_page;
    o.capacity = {kMaxSequences, kMaxSequences * (16 / w + 1) + 64 / w + 2, 120 / setup.compressed_rows_per_page,
                  96 / setup.index_key_rows_per_page};
    o.compressor_state_floats.assign(topology.size(), 0);
    o.compressor_state_floats[1] = 4 * 32;  // ratio 2: a kv and a score row per pending token
    return o;
  }

  size_t key_index(CacheKind k, int layer) const {
    for (size_t i = 0; i < keys_.size(); ++i)
      if (keys_[i].kind == k && keys_[i].layer == layer) return i;
    ADD_FAILURE() << "no pool key";
    return 0;
  }

  // x [n, dims] as the pool stores it: itself for float storage, decode(encode(x)) otherwise.
  std::vector<float> stored_values(const PagePool& pool, const std::vector<float>& x, int64_t n) const {
    if (pool.float_storage()) return x;
    const PageGeometry& g = pool.geometry();
    std::vector<std::byte> scratch(static_cast<size_t>((n + g.rows_per_page - 1) / g.rows_per_page * g.page_stride));
    std::vector<int64_t> slots(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) slots[i] = i;
    std::vector<float> out(x.size());
    encode_rows(g, x.data(), n, slots.data(), scratch.data(), pool.tensor_scale());
    decode_rows(g, scratch.data(), slots.data(), n, out.data(), pool.tensor_scale());
    return out;
  }

  std::vector<float> random_values(int64_t n) {
    std::normal_distribution<float> dist(0.0f, 1.5f);
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = dist(rng_);
    return x;
  }

  SequenceId random_sequence() {
    auto it = model_.begin();
    std::advance(it, std::uniform_int_distribution<size_t>(0, model_.size() - 1)(rng_));
    return it->first;
  }

  int64_t random_tokens() {
    // Mostly decode-like steps, sometimes chunks longer than the window.
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng_);
    if (kind < 5) return 1;
    if (kind < 9) return std::uniform_int_distribution<int64_t>(2, 9)(rng_);
    return std::uniform_int_distribution<int64_t>(10, 40)(rng_);
  }

  // ----- operations

  void add() {
    const SequenceId id = next_id_++;
    if (static_cast<int64_t>(model_.size()) == kMaxSequences) {
      expect_unchanged_on_error([&] { manager_.add_sequence(id); }, "sequence slots are in use");
      ++counts_["slots full"];
      return;
    }
    manager_.add_sequence(id);
    SequenceModel m;
    m.rows.resize(keys_.size());
    m.state[1].assign(static_cast<size_t>(manager_.compressor_state_floats(1)), 0.0f);
    model_[id] = std::move(m);
  }

  void release() {
    if (model_.empty()) return;
    const SequenceId id = random_sequence();
    manager_.release_sequence(id);
    model_.erase(id);
  }

  void fork() {
    if (model_.empty()) return;
    const SequenceId parent = random_sequence(), child = next_id_++;
    if (static_cast<int64_t>(model_.size()) == kMaxSequences) {
      expect_unchanged_on_error([&] { manager_.fork_sequence(parent, child); }, "sequence slots are in use");
      ++counts_["slots full"];
      return;
    }
    manager_.fork_sequence(parent, child);
    model_[child] = model_[parent];
    ++counts_["fork"];
  }

  // One step over 1-3 sequences. Each layer's rows are written either as a kernel does (the
  // step's slot arrays, all sequences at once) or per sequence and pool with write_rows.
  void extend() {
    if (model_.empty()) return;
    std::vector<CacheStepEntry> step;
    std::set<SequenceId> chosen;
    const int wanted = std::uniform_int_distribution<int>(1, 3)(rng_);
    for (int i = 0; i < wanted; ++i) {
      const SequenceId id = random_sequence();
      if (chosen.insert(id).second) step.push_back({id, random_tokens()});
    }
    bool shared_tail = false;  // does the step write into a page another sequence also holds?
    for (const auto& e : step) {
      for (const PoolKey& k : keys_) {
        const BlockTableView bt = manager_.block_table(e.sequence, k.kind, k.layer);
        const PagePool& pool = manager_.pool(k.kind, k.layer);
        const int64_t ratio = manager_.tokens_per_row(k.kind, k.layer);
        const int64_t first = model_[e.sequence].length / ratio, end = (model_[e.sequence].length + e.new_tokens) / ratio;
        const int64_t lp = first / pool.rows_per_page() - bt.first_logical_page;
        shared_tail |= end > first && lp < static_cast<int64_t>(bt.pages.size()) && pool.refcount(bt.pages[lp]) > 1;
      }
    }
    if (!try_reserve(step)) return;
    for (int l = 0; l < topology_.size(); ++l) {
      if (std::bernoulli_distribution(0.5)(rng_)) write_layer_by_slots(step, l);
      else for (const auto& e : step) write_layer_rows(e, l);
    }
    for (const auto& e : step) commit(e);
    ++counts_["extend"];
    if (shared_tail) ++counts_["copy-on-write step"];
  }

  // Reserve for one sequence, then fork it before it writes: the write itself must copy the
  // pages it now shares, and the child must keep the committed state only.
  void fork_after_reserve() {
    if (model_.empty()) return;
    const SequenceId parent = random_sequence();
    const CacheStepEntry e{parent, random_tokens()};
    if (!try_reserve({e})) return;
    if (static_cast<int64_t>(model_.size()) < kMaxSequences) {
      const SequenceId child = next_id_++;
      manager_.fork_sequence(parent, child);
      model_[child] = model_[parent];
      ++counts_["fork"];
    }
    try {
      for (int l = 0; l < topology_.size(); ++l) write_layer_rows(e, l);
    } catch (const Error& err) {
      // A copy found no page: the step is abandoned uncommitted, which the model never saw.
      EXPECT_NE(std::string(err.what()).find("is exhausted"), std::string::npos) << err.what();
      ++counts_["exhausted"];
      return;
    }
    commit(e);
    ++counts_["extend"];
  }

  bool try_reserve(const std::vector<CacheStepEntry>& step) {
    const auto before = snapshot();
    std::vector<std::vector<std::vector<int64_t>>> tables;  // [entry][key] -> pages
    for (const auto& e : step) {
      tables.emplace_back();
      for (const PoolKey& k : keys_) {
        const BlockTableView bt = manager_.block_table(e.sequence, k.kind, k.layer);
        tables.back().emplace_back(bt.pages.begin(), bt.pages.end());
      }
    }
    try {
      // Every held page that reserve replaced is one reported copy, with the same bytes.
      using Move = std::tuple<CacheKind, int, int64_t, int64_t>;
      std::multiset<Move> reported, observed;
      for (const PageCopy& c : manager_.reserve(step)) {
        reported.insert({c.kind, c.layer, c.from, c.to});
        const PagePool& pool = manager_.pool(c.kind, c.layer);
        EXPECT_TRUE(std::equal(pool.bytes().begin() + pool.page_offset(c.from),
                               pool.bytes().begin() + pool.page_offset(c.from) + pool.page_stride(),
                               pool.bytes().begin() + pool.page_offset(c.to)));
      }
      for (size_t e = 0; e < step.size(); ++e) {
        for (size_t i = 0; i < keys_.size(); ++i) {
          const BlockTableView bt = manager_.block_table(step[e].sequence, keys_[i].kind, keys_[i].layer);
          for (size_t k = 0; k < tables[e][i].size(); ++k)
            if (bt.pages[k] != tables[e][i][k]) observed.insert({keys_[i].kind, keys_[i].layer, tables[e][i][k], bt.pages[k]});
        }
      }
      EXPECT_EQ(reported, observed);
      return true;
    } catch (const Error& err) {
      const std::string what = err.what();
      EXPECT_EQ(what.rfind("dsv4: kv_cache: pool '", 0), 0u) << what;
      EXPECT_NE(what.find("is exhausted"), std::string::npos) << what;
      EXPECT_NE(what.find("(reserving sequence " + std::to_string(step[0].sequence)), std::string::npos) << what;
      EXPECT_EQ(snapshot(), before) << "a failed reserve changed the caches";
      ++counts_["exhausted"];
      return false;
    }
  }

  void write_layer_by_slots(const std::vector<CacheStepEntry>& step, int layer) {
    const LayerStepSlots slots = manager_.step_slots(step, layer);
    const int64_t tokens = static_cast<int64_t>(slots.window.size());
    for (CacheKind k : {CacheKind::window, CacheKind::compressed, CacheKind::index_keys}) {
      if (!manager_.has_pool(k, layer)) continue;
      const PagePool& pool = manager_.pool(k, layer);
      const std::vector<int64_t>& s = k == CacheKind::window ? slots.window
                                      : k == CacheKind::compressed ? slots.compressed : slots.index_keys;
      const std::vector<float> x = random_values(tokens * pool.dims());
      manager_.write_slots(k, layer, s.data(), tokens, x.data());
      const std::vector<float> stored = stored_values(pool, x, tokens);
      // Token t of the step at position p writes window row p, or entry (p + 1) / ratio - 1 when
      // it closes a group.
      const int64_t ratio = manager_.tokens_per_row(k, layer);
      int64_t t = 0;
      for (const auto& e : step) {
        auto& rows = model_[e.sequence].rows[key_index(k, layer)];
        for (int64_t p = model_[e.sequence].length; p < model_[e.sequence].length + e.new_tokens; ++p, ++t) {
          if ((p + 1) % ratio != 0) {
            EXPECT_EQ(s[t], -1);
            continue;
          }
          const int64_t row = (p + 1) / ratio - 1;
          EXPECT_EQ(s[t], manager_.slot(e.sequence, k, layer, row));
          rows.resize(std::max<size_t>(rows.size(), row + 1));
          rows[row].assign(stored.begin() + t * pool.dims(), stored.begin() + (t + 1) * pool.dims());
        }
      }
    }
  }

  void write_layer_rows(const CacheStepEntry& e, int layer) {
    SequenceModel& m = model_[e.sequence];
    for (CacheKind k : {CacheKind::window, CacheKind::compressed, CacheKind::index_keys}) {
      if (!manager_.has_pool(k, layer)) continue;
      const PagePool& pool = manager_.pool(k, layer);
      const int64_t ratio = manager_.tokens_per_row(k, layer);
      const int64_t first = m.length / ratio, count = (m.length + e.new_tokens) / ratio - first;
      const std::vector<float> x = random_values(count * pool.dims());
      manager_.write_rows(e.sequence, k, layer, first, count, x.data());
      const std::vector<float> stored = stored_values(pool, x, count);
      auto& rows = m.rows[key_index(k, layer)];
      rows.resize(std::max<size_t>(rows.size(), first + count));
      for (int64_t r = 0; r < count; ++r)
        rows[first + r].assign(stored.begin() + r * pool.dims(), stored.begin() + (r + 1) * pool.dims());
    }
  }

  // Commits the whole step, or now and then only part of it (the rest stays reserved, unseen).
  void commit(const CacheStepEntry& e) {
    SequenceModel& m = model_[e.sequence];
    const bool partial = std::bernoulli_distribution(0.1)(rng_);
    const int64_t new_length = m.length + (partial ? std::uniform_int_distribution<int64_t>(0, e.new_tokens - 1)(rng_)
                                                   : e.new_tokens);
    manager_.commit(e.sequence, new_length);
    m.length = new_length;
    for (size_t i = 0; i < keys_.size(); ++i)
      m.rows[i].resize(std::min<size_t>(m.rows[i].size(), new_length / manager_.tokens_per_row(keys_[i].kind, keys_[i].layer)));
    const std::vector<float> state = random_values(manager_.compressor_state_floats(1));
    std::copy(state.begin(), state.end(), manager_.compressor_state(e.sequence, 1).begin());
    m.state[1] = state;
  }

  // ----- checks

  template <class Fn>
  void expect_unchanged_on_error(Fn fn, const std::string& part) {
    const auto before = snapshot();
    try {
      fn();
      ADD_FAILURE() << "no error, expected one containing: " << part;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(part), std::string::npos) << err.what();
    }
    EXPECT_EQ(snapshot(), before);
  }

  // Everything observable: sequences, lengths, block tables, reference counts, pool bytes.
  std::vector<int64_t> snapshot() const {
    std::vector<int64_t> s;
    for (const SequenceId id : manager_.sequences()) {
      s.insert(s.end(), {id, manager_.sequence_length(id)});
      for (const PoolKey& k : keys_) {
        const BlockTableView bt = manager_.block_table(id, k.kind, k.layer);
        s.push_back(bt.first_logical_page);
        s.insert(s.end(), bt.pages.begin(), bt.pages.end());
      }
    }
    for (const PagePool* p : manager_.pools()) {
      for (int64_t page = 0; page < p->num_pages(); ++page) s.push_back(p->refcount(page));
      uint64_t hash = 14695981039346656037u;  // FNV-1a
      for (const std::byte b : p->bytes()) hash = (hash ^ static_cast<uint64_t>(b)) * 1099511628211u;
      s.push_back(static_cast<int64_t>(hash >> 1));
    }
    return s;
  }

  void verify() {
    std::vector<SequenceId> ids;
    for (const auto& [id, m] : model_) ids.push_back(id);
    ASSERT_EQ(manager_.sequences(), ids);
    const int64_t window = config_.sliding_window;
    for (const auto& [id, m] : model_) {
      ASSERT_EQ(manager_.sequence_length(id), m.length) << "sequence " << id;
      int64_t bytes = 0;
      for (size_t i = 0; i < keys_.size(); ++i) {
        const PoolKey& k = keys_[i];
        const PagePool& pool = manager_.pool(k.kind, k.layer);
        const int64_t rpp = pool.rows_per_page();
        const int64_t end = m.length / manager_.tokens_per_row(k.kind, k.layer);
        const int64_t first = k.kind == CacheKind::window ? std::max<int64_t>(0, m.length - window) : 0;
        ASSERT_EQ(manager_.first_readable_row(id, k.kind, k.layer), first);
        const BlockTableView bt = manager_.block_table(id, k.kind, k.layer);
        // Window pages wholly before the window are gone; every committed row has a page.
        EXPECT_EQ(bt.first_logical_page, first / rpp) << pool.name() << " sequence " << id;
        EXPECT_GE(static_cast<int64_t>(bt.pages.size()) + bt.first_logical_page, (end + rpp - 1) / rpp);
        bytes += static_cast<int64_t>(bt.pages.size()) * pool.page_stride();
        std::vector<float> out(static_cast<size_t>((end - first) * pool.dims()));
        manager_.read_rows(id, k.kind, k.layer, first, end - first, out.data());
        for (int64_t r = first; r < end; ++r) {
          ASSERT_TRUE(std::equal(m.rows[i][r].begin(), m.rows[i][r].end(), out.begin() + (r - first) * pool.dims()))
              << pool.name() << " sequence " << id << " row " << r;
        }
        if (first > 0 && k.layer == 0) {
          float row[512];
          try {
            manager_.read_rows(id, k.kind, k.layer, first - 1, 1, row);
            ADD_FAILURE() << "read of a position that left the window succeeded";
          } catch (const Error& err) {
            EXPECT_NE(std::string(err.what()).find("has left the window"), std::string::npos) << err.what();
          }
        }
      }
      const auto state = manager_.compressor_state(id, 1);
      EXPECT_TRUE(std::equal(state.begin(), state.end(), m.state.at(1).begin(), m.state.at(1).end()));
      EXPECT_EQ(manager_.sequence_bytes(id), bytes + static_cast<int64_t>(state.size() * sizeof(float)));
    }
    verify_table_mirror();
    // Reference counts are exactly the block-table references; free pages are the unreferenced ones.
    for (const PoolKey& k : keys_) {
      const PagePool& pool = manager_.pool(k.kind, k.layer);
      std::vector<int32_t> references(static_cast<size_t>(pool.num_pages()), 0);
      for (const auto& [id, m] : model_)
        for (const int64_t page : manager_.block_table(id, k.kind, k.layer).pages) ++references.at(page);
      int64_t free = 0, shared = 0;
      for (int64_t page = 0; page < pool.num_pages(); ++page) {
        ASSERT_EQ(pool.refcount(page), references[page]) << pool.name() << " page " << page;
        free += references[page] == 0;
        shared += references[page] > 1;
      }
      const PoolStats s = pool.stats();
      EXPECT_EQ(s.free_pages, free) << pool.name();
      EXPECT_EQ(s.shared_pages, shared) << pool.name();
      EXPECT_EQ(s.free_pages + s.used_pages, s.total_pages) << pool.name();
    }
  }

  // A device mirror of the tables by sequence slot, kept up to date from take_table_changes()
  // alone, must equal every table after every operation: no change goes unreported.
  void verify_table_mirror() {
    for (const KvCacheManager::TableChange& c : manager_.take_table_changes()) {
      const BlockTableView t = manager_.slot_block_table(c.pool, c.slot);
      mirror_[{c.pool, c.slot}] = {t.first_logical_page, std::vector<int64_t>(t.pages.begin(), t.pages.end())};
    }
    const int pools = static_cast<int>(manager_.pools().size());
    for (int pool = 0; pool < pools; ++pool)
      for (int64_t slot = 0; slot < manager_.options().capacity.max_sequences; ++slot) {
        const BlockTableView t = manager_.slot_block_table(pool, slot);
        const auto it = mirror_.find({pool, slot});
        const MirroredTable expected{t.first_logical_page, std::vector<int64_t>(t.pages.begin(), t.pages.end())};
        const MirroredTable held = it == mirror_.end() ? MirroredTable{} : it->second;
        ASSERT_EQ(held.pages, expected.pages) << "pool " << pool << " slot " << slot;
        if (!expected.pages.empty()) ASSERT_EQ(held.first_logical_page, expected.first_logical_page);
      }
    for (const auto& [id, m] : model_)
      for (const PoolKey& k : keys_) {
        const BlockTableView by_id = manager_.block_table(id, k.kind, k.layer);
        const BlockTableView by_slot =
            manager_.slot_block_table(manager_.pool_index(k.kind, k.layer), manager_.sequence_slot(id));
        ASSERT_TRUE(std::equal(by_id.pages.begin(), by_id.pages.end(), by_slot.pages.begin(), by_slot.pages.end()));
      }
  }

  struct MirroredTable {
    int64_t first_logical_page = 0;
    std::vector<int64_t> pages;
  };
  std::map<std::pair<int, int64_t>, MirroredTable> mirror_;
  ModelConfig config_;
  ModelTopology topology_;
  KvCacheManager manager_;
  std::mt19937 rng_;
  std::vector<PoolKey> keys_;
  std::map<SequenceId, SequenceModel> model_;
  SequenceId next_id_ = 100;
  std::map<std::string, int> counts_;
};

void PrintTo(const StressSetup& s, std::ostream* os) { *os << s.name; }

// The sanitized build (tests/asan.cmake) runs half of the operations: it is several times slower.
#ifdef DSV4_STRESS_SANITIZED
constexpr int kOperationsDivisor = 2;
#else
constexpr int kOperationsDivisor = 1;
#endif

class PagedCacheStress : public ::testing::TestWithParam<StressSetup> {};

TEST_P(PagedCacheStress, MatchesTheModelAfterEveryOperation) {
  Stress stress(GetParam());
  stress.run(GetParam().operations / kOperationsDivisor);
}

INSTANTIATE_TEST_SUITE_P(
    Seeds, PagedCacheStress,
    ::testing::Values(
        // Pages of 4 / 4 / 2 rows: window edges fall on page edges.
        StressSetup{"float_pages_4_4_2", 1, 3000, std::nullopt, 4, 4, 2},
        // Odd page sizes: page edges never line up with the window or with ratio-2 groups.
        StressSetup{"float_pages_3_5_1", 2, 3000, std::nullopt, 3, 5, 1},
        // A window page as long as the window, tiny compressed pages.
        StressSetup{"float_pages_16_2_8", 3, 3000, std::nullopt, 16, 2, 8},
        // Real byte formats (512-wide rows, the formats' own page sizes are too large here).
        StressSetup{"v41_native_pages_8_4_4", 4, 300, std::string("v4.1-native"), 8, 4, 4},
        StressSetup{"fp8_ds_mla_pages_4_8_2", 5, 200, std::string("fp8_ds_mla"), 4, 8, 2}),
    [](const ::testing::TestParamInfo<StressSetup>& setup) { return setup.param.name; });

}  // namespace
}  // namespace dsv4
