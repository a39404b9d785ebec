// Image spans (SPEC §14): the window rule against the SPEC's worked example and a literal port of
// DeepSeek's Vision-Exp get_image_visible / get_window_topk_idxs_visible on vLLM's test cases; the
// CPU engine with spans against a masked attention computed here from the reference ops; what
// spans must leave alone (text tokens, the indexer's picks, the caches); the span checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/image_spans.h"
#include "dsv4/config.h"
#include "dsv4/engine.h"
#include "dsv4/weights.h"
#include "engine/cpu_engine.h"
#include "reference/layer.h"
#include "reference/ops.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::hashed_value;

// ---------------------------------------------------------------------------------------------
// The rule

// The rows token p of a sequence of `seqlen` tokens sees, as the official code computes them over
// token types (SPEC §14.3, VX verbatim): spans mark IMAGE_START at first and IMAGE_END at last.
std::vector<WindowRange> official_windows(int64_t seqlen, int64_t W, int64_t M, const std::vector<ImageSpan>& spans) {
  std::vector<int> is_start(seqlen, 0), is_end(seqlen, 0);
  for (const ImageSpan& s : spans) is_start[s.first] = 1, is_end[s.last] = 1;
  std::vector<int64_t> left(seqlen), right(seqlen);
  int64_t starts = 0, opened = 0, closed = 0;
  for (int64_t i = 0; i < seqlen; ++i) {  // cumsum, cummax
    opened += is_start[i], closed += is_end[i];
    const bool valid = opened > closed || is_end[i];
    starts = std::max(starts, is_start[i] ? i : 0);
    left[i] = (i - starts) * valid;
  }
  int64_t ends = seqlen;
  opened = closed = 0;
  std::vector<int> valid(seqlen);
  for (int64_t i = 0; i < seqlen; ++i) opened += is_start[i], closed += is_end[i], valid[i] = opened > closed || is_end[i];
  for (int64_t i = seqlen - 1; i >= 0; --i) {  // reverse cummin
    ends = std::min(ends, is_end[i] ? i : seqlen);
    right[i] = (ends - i) * valid[i];
  }
  std::vector<WindowRange> out;
  for (int64_t i = 0; i < seqlen; ++i) {
    const int64_t l = std::min(left[i], M - 1), r = std::min(right[i], M);
    const int64_t width = std::min(seqlen, W + M), left_add = std::max<int64_t>(l - (W - 1), 0);
    const int64_t start = std::max<int64_t>(i - (W - 1) - left_add, 0);
    std::vector<int64_t> rows;
    for (int64_t j = 0; j < width; ++j)
      if (start + j <= i + r) rows.push_back(start + j);
    for (size_t j = 1; j < rows.size(); ++j) EXPECT_EQ(rows[j], rows[j - 1] + 1);  // one contiguous range
    out.push_back({rows.front(), rows.back()});
  }
  return out;
}

// The library's rule over the same sequence.
std::vector<WindowRange> library_windows(int64_t seqlen, int64_t W, int64_t M, const std::vector<ImageSpan>& spans) {
  std::vector<WindowRange> out;
  for (int64_t p = 0; p < seqlen; ++p) {
    WindowRange w = causal_window(p, W);
    for (const ImageSpan& s : spans)
      if (s.first <= p && p <= s.last) w = image_span_window(p, W, M, s);
    out.push_back(w);
  }
  return out;
}

void expect_windows(const std::vector<WindowRange>& got, const std::vector<WindowRange>& expected, int64_t from = 0) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t p = static_cast<size_t>(from); p < got.size(); ++p) {
    EXPECT_EQ(got[p].first, expected[p].first) << "position " << p;
    EXPECT_EQ(got[p].last, expected[p].last) << "position " << p;
  }
}

TEST(ImageSpanRule, SpecWorkedExample) {
  // W = 4, M = 6, span [3, 8] (SPEC §14.3).
  const ImageSpan span{3, 8};
  const auto window = [&](int64_t p) { return image_span_window(p, 4, 6, span); };
  EXPECT_EQ(window(3).first, 0);
  EXPECT_EQ(window(3).last, 8);
  EXPECT_EQ(window(5).first, 2);
  EXPECT_EQ(window(5).last, 8);
  EXPECT_EQ(window(8).first, 3);  // left 5: left_add 2
  EXPECT_EQ(window(8).last, 8);
  EXPECT_EQ(causal_window(9, 4).first, 6);  // text
  EXPECT_EQ(causal_window(9, 4).last, 9);
  // Every span token sees the whole span and its causal window.
  const std::vector<WindowRange> expected = {{0, 0}, {0, 1}, {0, 2}, {0, 8}, {1, 8}, {2, 8},
                                             {3, 8}, {3, 8}, {3, 8}, {6, 9}, {7, 10}};
  expect_windows(library_windows(11, 4, 6, {span}), expected);
  expect_windows(official_windows(11, 4, 6, {span}), expected);
}

TEST(ImageSpanRule, VllmCases) {
  // vLLM's cases (W = 8, M = 6), the first two with spans longer than M (their tokens see M - 1
  // to the left and M to the right).
  const int64_t W = 8, M = 6;
  const std::vector<ImageSpan> two{{4, 12}, {20, 24}};
  expect_windows(library_windows(30, W, M, two), official_windows(30, W, M, two));
  const std::vector<WindowRange> first_span = {{0, 10}, {0, 11}, {0, 12}, {0, 12}, {1, 12}, {2, 12}, {3, 12},
                                               {4, 12}, {5, 12}};
  for (int64_t p = 4; p <= 12; ++p) {
    EXPECT_EQ(image_span_window(p, W, M, two[0]).first, first_span[p - 4].first) << p;
    EXPECT_EQ(image_span_window(p, W, M, two[0]).last, first_span[p - 4].last) << p;
  }
  expect_windows(library_windows(30, W, M, {}), official_windows(30, W, M, {}));  // the text request
  const std::vector<ImageSpan> long_span{{2, 17}};
  expect_windows(library_windows(24, W, M, long_span), official_windows(24, W, M, long_span));
  // Seq 40, the second chunk of 16 (positions 24..39) carries span (30, 38).
  const std::vector<ImageSpan> chunked{{30, 38}};
  expect_windows(library_windows(40, W, M, chunked), official_windows(40, W, M, chunked), 24);
  const std::vector<ImageSpan> at_end{{0, 6}};  // ends at the prompt's end
  expect_windows(library_windows(7, W, M, at_end), official_windows(7, W, M, at_end));
  EXPECT_EQ(image_span_window(0, W, M, at_end[0]).last, 6);
}

TEST(ImageSpanRule, SpansOfAtMostMTokensAreSeenWhole) {
  for (int64_t W : {1, 3, 16})
    for (int64_t M : {1, 5, 24})
      for (int64_t length = 1; length <= M; ++length) {
        const ImageSpan s{7, 7 + length - 1};
        for (int64_t p = s.first; p <= s.last; ++p) {
          const WindowRange w = image_span_window(p, W, M, s);
          EXPECT_EQ(w.first, std::min(causal_window(p, W).first, s.first)) << W << " " << M << " " << p;
          EXPECT_EQ(w.last, s.last);
          EXPECT_LE(w.last - w.first + 1, W + M);
        }
      }
}

// ---------------------------------------------------------------------------------------------
// The engine

struct Model {
  ModelConfig config;
  ModelTopology topology;
  std::shared_ptr<const ModelWeights> weights;
};

// tiny-v4.1 (W = 16) or tiny-v4 taking image spans of up to M = 24 tokens.
Model tiny_model(const std::string& preset, int64_t M = 24) {
  Model m;
  m.config = preset_config(preset);
  m.config.vision_max_n_token = M;
  m.topology = resolve_topology(m.config);
  m.weights = std::make_shared<ModelWeights>(random_weights(m.config, m.topology, 11, false));
  return m;
}

std::unique_ptr<Engine> make_engine(const Model& m, Precision precision, const std::string& kv_format = "") {
  EngineOptions options;
  options.precision = precision;
  options.cache_storage = kv_format.empty() ? CacheStorage::float_rows : CacheStorage::paged;
  options.kv_format = kv_format;
  options.max_sequences = 4;
  options.max_context = 256;
  options.max_tokens_per_step = 256;
  return Engine::create(m.config, m.weights, options);
}

// Every layer's outputs and picks per sequence (in position order) over a list of steps; a
// sequence's inputs depend on its index and the position only.
struct Recorded {
  std::vector<std::map<int, std::vector<float>>> outputs;  // [sequence][layer]: [positions, hidden]
  std::vector<std::map<int, std::vector<int32_t>>> picks;  // [sequence][index layer]: [positions, k]
};

struct Entry {
  int sequence;
  int64_t tokens;
  std::vector<ImageSpan> spans = {};
};

Recorded run_steps(Engine& engine, int sequences, const std::vector<std::vector<Entry>>& steps) {
  const ModelConfig& c = engine.config();
  std::vector<SequenceId> ids;
  for (int s = 0; s < sequences; ++s) ids.push_back(engine.add_sequence());
  Recorded run;
  run.outputs.resize(static_cast<size_t>(sequences));
  run.picks.resize(static_cast<size_t>(sequences));
  for (const std::vector<Entry>& step : steps) {
    std::vector<StepEntry> entries;
    int64_t T = 0;
    for (const Entry& e : step) entries.push_back({ids[e.sequence], e.tokens, e.spans}), T += e.tokens;
    engine.begin_step(entries);
    std::vector<float> in(static_cast<size_t>(T * c.hidden_size)), out(in.size());
    for (int l = 0; l < c.num_layers; ++l) {
      int64_t t = 0;
      for (const Entry& e : step)
        for (int64_t i = 0; i < e.tokens; ++i, ++t) {
          const int64_t p = engine.sequence_length(ids[e.sequence]) + i;
          for (int64_t ch = 0; ch < c.hidden_size; ++ch)
            in[t * c.hidden_size + ch] = hashed_value(static_cast<uint64_t>(e.sequence) + 1, p, l, ch);
        }
      engine.run_layer(l, TensorView::contiguous(in.data(), DType::f32, {T, c.hidden_size}),
                       TensorView::contiguous(out.data(), DType::f32, {T, c.hidden_size}));
      const HostTensor picks = engine.topology()[l].owns_indexer ? engine.layer_picks(l) : HostTensor();
      t = 0;
      for (const Entry& e : step) {
        auto& o = run.outputs[e.sequence][l];
        o.insert(o.end(), out.begin() + t * c.hidden_size, out.begin() + (t + e.tokens) * c.hidden_size);
        if (!picks.empty()) {
          auto& p = run.picks[e.sequence][l];
          p.insert(p.end(), picks.as<int32_t>() + t * c.index_topk, picks.as<int32_t>() + (t + e.tokens) * c.index_topk);
        }
        t += e.tokens;
      }
    }
    engine.end_step();
  }
  return run;
}

// Rows [first, last] of a sequence's recorded outputs of `layer`.
std::vector<float> rows(const Recorded& r, int s, int layer, int64_t first, int64_t last, int64_t hidden) {
  const std::vector<float>& o = r.outputs[s].at(layer);
  return std::vector<float>(o.begin() + first * hidden, o.begin() + (last + 1) * hidden);
}

// Layer 0 (window only) of a sequence of n tokens whose prompt has `spans`, computed here from the
// reference ops: token p attends the positions `visible(p)` gives, nothing else.
std::vector<float> masked_window_layer(const Model& m, int64_t n, int stream,
                                       const std::function<std::pair<int64_t, int64_t>(int64_t)>& visible) {
  const ModelConfig& c = m.config;
  const LayerRecipe recipe = layer_recipe(c, m.topology[0], Precision::fp32, c.index_n_heads);
  const reference::LayerParameters L = reference::prepare_layer(c, recipe, m.weights->layers[0]);
  const int64_t hidden = c.hidden_size, H = c.num_heads, D = c.head_dim, rd = c.rope_head_dim;
  std::vector<float> x(static_cast<size_t>(n * hidden));
  std::vector<int64_t> positions;
  for (int64_t p = 0; p < n; ++p) {
    positions.push_back(p);
    for (int64_t ch = 0; ch < hidden; ++ch) x[p * hidden + ch] = hashed_value(static_cast<uint64_t>(stream) + 1, p, 0, ch);
  }
  const auto linear = [&](const std::vector<float>& in, const reference::Projection& w) {
    std::vector<float> y(static_cast<size_t>(n * w.out));
    reference::linear(in.data(), n, w.in, w.weight.data(), w.out, y.data(), {});
    return y;
  };
  std::vector<float> qr = linear(x, L.wq_a);
  reference::rms_norm(qr.data(), n, c.q_lora_rank, L.q_norm.data(), recipe.eps, qr.data(), false);
  std::vector<float> q = linear(qr, L.wq_b);
  reference::apply_rope(q.data(), n, H, D, recipe.rope_frequencies.data(), rd, positions.data(), false, false);
  std::vector<float> kv = linear(x, L.wkv);
  reference::rms_norm(kv.data(), n, D, L.kv_norm.data(), recipe.eps, kv.data(), false);
  reference::apply_rope(kv.data(), n, 1, D, recipe.rope_frequencies.data(), rd, positions.data(), false, false);
  std::vector<float> o(static_cast<size_t>(n * H * D));
  for (int64_t p = 0; p < n; ++p) {
    const auto [first, last] = visible(p);
    std::vector<const float*> attended;
    for (int64_t j = first; j <= last; ++j) attended.push_back(kv.data() + j * D);
    reference::sparse_attention(q.data() + p * H * D, H, D, attended.data(), static_cast<int64_t>(attended.size()),
                                L.attn_sink.data(), recipe.softmax_scale, false, o.data() + p * H * D);
  }
  reference::apply_rope(o.data(), n, H, D, recipe.rope_frequencies.data(), rd, positions.data(), true, false);
  const int64_t G = c.o_groups, R = c.o_lora_rank;
  std::vector<float> y(static_cast<size_t>(n * G * R));
  reference::grouped_linear(o.data(), n, G, H / G * D, L.wo_a.weight.data(), R, y.data(), false);
  return linear(y, L.wo_b);
}

double relative_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * double(a[i] - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / std::max(den, 1e-30));
}

TEST(ImageSpanEngine, WindowLayerIsTheMaskedAttention) {
  // W = 16, M = 24: a 40-token prompt with spans [3, 8] and [12, 35] (24 tokens: its last ones see
  // 23 back, beyond the causal window).
  const Model m = tiny_model("tiny-v4.1");
  ASSERT_EQ(m.config.sliding_window, 16);
  ASSERT_EQ(m.topology[0].compress_ratio, 0);
  const std::vector<ImageSpan> spans{{12, 35}, {3, 8}};  // any order
  const auto engine = make_engine(m, Precision::fp32);
  const Recorded run = run_steps(*engine, 1, {{{0, 40, spans}}});
  const auto visible = [](int64_t p) -> std::pair<int64_t, int64_t> {
    const int64_t causal_first = std::max<int64_t>(0, p - 15);
    if (3 <= p && p <= 8) return {causal_first, 8};
    if (12 <= p && p <= 35) return {std::min<int64_t>(causal_first, 12), 35};
    return {causal_first, p};
  };
  const std::vector<float> expected = masked_window_layer(m, 40, 0, visible);
  const int64_t hidden = m.config.hidden_size;
  for (int64_t p = 0; p < 40; ++p) {
    const std::vector<float> got = rows(run, 0, 0, p, p, hidden);
    const std::vector<float> want(expected.begin() + p * hidden, expected.begin() + (p + 1) * hidden);
    EXPECT_LE(relative_l2(got, want), 1e-6) << "position " << p;
  }
  // The causal attention differs inside the spans (all but their last tokens).
  const std::vector<float> causal = masked_window_layer(m, 40, 0, [](int64_t p) {
    return std::pair<int64_t, int64_t>{std::max<int64_t>(0, p - 15), p};
  });
  EXPECT_GT(relative_l2(rows(run, 0, 0, 12, 12, hidden),
                        std::vector<float>(causal.begin() + 12 * hidden, causal.begin() + 13 * hidden)),
            1e-3);
}

struct EngineCase {
  const char* preset;
  Precision precision;
  const char* kv_format;
};

class ImageSpanEngineCases : public testing::TestWithParam<EngineCase> {};

// Tokens outside spans, the indexer's picks, the compressed caches and every later step are those
// of the run without spans, bit for bit; a span of one token is no span at all.
TEST_P(ImageSpanEngineCases, SpansChangeOnlyTheSpanTokensWindows) {
  const Model m = tiny_model(GetParam().preset);
  const auto engine = [&] { return make_engine(m, GetParam().precision, GetParam().kv_format); };
  // Sequence 0: a 37-token prefill with spans [4, 27] (24 = M) and [30, 33], then a second chunk of
  // 12 with span [40, 45], then decode steps. Sequence 1 is text only, in the same steps.
  const std::vector<std::vector<Entry>> with_spans = {
      {{0, 37, {{4, 27}, {30, 33}}}, {1, 20}}, {{0, 12, {{40, 45}}}, {1, 1}}, {{0, 1}, {1, 1}}, {{0, 1}, {1, 1}}};
  std::vector<std::vector<Entry>> without = with_spans;
  for (auto& step : without)
    for (Entry& e : step) e.spans.clear();
  std::vector<std::vector<Entry>> single = without;
  single[0][0].spans = {{5, 5}, {36, 36}};
  const auto a = engine(), b = engine(), s = engine();
  const Recorded spanned = run_steps(*a, 2, with_spans), plain = run_steps(*b, 2, without), singles = run_steps(*s, 2, single);
  const int64_t hidden = m.config.hidden_size;
  for (int l = 0; l < m.config.num_layers; ++l) {
    EXPECT_EQ(singles.outputs[0].at(l), plain.outputs[0].at(l)) << "layer " << l;
    EXPECT_EQ(spanned.outputs[1].at(l), plain.outputs[1].at(l)) << "layer " << l;
    // Text positions of sequence 0: before the first span, between spans, after them.
    for (auto [first, last] : {std::pair<int64_t, int64_t>{0, 3}, {28, 29}, {34, 39}, {46, 50}})
      EXPECT_EQ(rows(spanned, 0, l, first, last, hidden), rows(plain, 0, l, first, last, hidden))
          << "layer " << l << " positions " << first << ".." << last;
    // The last token of a span no longer than the window sees its causal window.
    EXPECT_EQ(rows(spanned, 0, l, 33, 33, hidden), rows(plain, 0, l, 33, 33, hidden)) << "layer " << l;
    EXPECT_NE(rows(spanned, 0, l, 4, 26, hidden), rows(plain, 0, l, 4, 26, hidden)) << "layer " << l;
  }
  for (const auto& [l, p] : plain.picks[0]) EXPECT_EQ(spanned.picks[0].at(l), p) << "index layer " << l;
}

INSTANTIATE_TEST_SUITE_P(Presets, ImageSpanEngineCases,
                         testing::Values(EngineCase{"tiny-v4.1", Precision::reference, ""},
                                         EngineCase{"tiny-v4.1", Precision::reference, "v4.1-native"},
                                         EngineCase{"tiny-v4.1", Precision::fp32, ""},
                                         EngineCase{"tiny-v4", Precision::reference, "fp8_ds_mla"},
                                         EngineCase{"tiny-v4", Precision::fp32, ""}),
                         [](const testing::TestParamInfo<EngineCase>& info) {
                           std::string name = std::string(info.param.preset) + "_" +
                                              precision_name(info.param.precision) + "_" +
                                              (*info.param.kv_format ? info.param.kv_format : "float");
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

TEST(ImageSpanEngine, MalformedSpansAreRejectedNamingSequenceAndSpan) {
  const Model m = tiny_model("tiny-v4.1");
  const auto engine = make_engine(m, Precision::reference);
  const SequenceId a = engine->add_sequence(), b = engine->add_sequence();
  const auto error = [&](std::vector<StepEntry> entries) { return test::error_of([&] { engine->begin_step(entries); }); };
  EXPECT_EQ(error({{a, 10}, {b, 10, {{8, 3}}}}), "dsv4: engine: begin_step: sequence 1: image span [8, 3] ends before it starts");
  EXPECT_EQ(error({{a, 10, {{2, 5}, {5, 7}}}}), "dsv4: engine: begin_step: sequence 0: image spans [2, 5] and [5, 7] overlap");
  EXPECT_EQ(error({{a, 10, {{6, 12}}}}),
            "dsv4: engine: begin_step: sequence 0: image span [6, 12] does not lie inside the entry's chunk, positions 0 "
            "to 9; a span must be prefilled in one chunk (SPEC §14.5)");
  EXPECT_EQ(error({{a, 30, {{0, 24}}}}),
            "dsv4: engine: begin_step: sequence 0: image span [0, 24] has 25 tokens, more than vision_max_n_token 24");
  // Nothing changed: the same sequences take a valid step, then a span may not reach back.
  engine->begin_step({{a, 10, {{2, 5}, {6, 9}}}, {b, 4}});
  std::vector<float> in(static_cast<size_t>(14 * m.config.hidden_size), 0.5f), out(in.size());
  for (int l = 0; l < m.config.num_layers; ++l)
    engine->run_layer(l, TensorView::contiguous(in.data(), DType::f32, {14, m.config.hidden_size}),
                      TensorView::contiguous(out.data(), DType::f32, {14, m.config.hidden_size}));
  engine->end_step();
  EXPECT_EQ(error({{a, 5, {{8, 12}}}}),
            "dsv4: engine: begin_step: sequence 0: image span [8, 12] does not lie inside the entry's chunk, positions "
            "10 to 14; a span must be prefilled in one chunk (SPEC §14.5)");
  EXPECT_EQ(error({{a, 1, {{10, 10}}}}),
            "dsv4: engine: begin_step: sequence 0: image span [10, 10] is in a decode entry (one token at position 10); "
            "image spans belong to the prefill chunk that carries all of their tokens");
  EXPECT_EQ(engine->sequence_length(a), 10);

  const Model no_vision = tiny_model("tiny-v4.1", 0);
  const auto plain = make_engine(no_vision, Precision::reference);
  const SequenceId s = plain->add_sequence();
  EXPECT_EQ(test::error_of([&] { plain->begin_step({{s, 10, {{2, 5}}}}); }),
            "dsv4: engine: begin_step: sequence 0: image span [2, 5] is given, but the model takes no image spans (its "
            "config's vision_max_n_token is 0)");
}

TEST(ImageSpanConfig, VisionMaxTokensFromEachConfigForm) {
  EXPECT_EQ(preset_config("v4.1-flash").vision_max_n_token, 1024);
  EXPECT_EQ(preset_config("v4-flash").vision_max_n_token, 0);
  const std::string model_args =
      R"({"dim": 256, "n_layers": 2, "n_heads": 4, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64,
          "compress_ratios": [0, 1], "kv_source_layers": [1], "index_source_layers": [1], "index_topk": 8)";
  EXPECT_EQ(parse_config_json(model_args + "}").vision_max_n_token, 1024);  // V4.1 ModelArgs default
  EXPECT_EQ(parse_config_json(model_args + R"(, "vision_max_n_token": 384})").vision_max_n_token, 384);
  EXPECT_EQ(parse_config_json(model_args + R"(, "vision_max_n_token": 384, "vision_n_layers": 0})").vision_max_n_token, 0);
  const std::string nested =
      R"({"text_config": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": 128,
          "o_groups": 2, "o_lora_rank": 64, "compress_ratios": [0, 1], "kv_source_layer_ids": [1],
          "index_source_layer_ids": [1], "index_topk": 8}, "vision_config": {"max_image_tokens": 512}})";
  EXPECT_EQ(parse_config_json(nested).vision_max_n_token, 512);
  EXPECT_NE(test::error_of([&] { parse_config_json(model_args + R"(, "vision_max_n_token": -1})"); }).find("vision_max_n_token"),
            std::string::npos);
}

}  // namespace
}  // namespace dsv4
