// The README's C++ API example as an installed-package consumer: built against `find_package(dsv4)`
// after `cmake --install` by tests/install.cmake.
#include <dsv4/config.h>
#include <dsv4/engine.h>
#include <dsv4/weights.h>

#include <cstdio>
#include <vector>

int main() {
  dsv4::ModelConfig config = dsv4::preset_config("tiny-v4.1");
  dsv4::ModelTopology topology = dsv4::resolve_topology(config);
  auto weights = std::make_shared<dsv4::ModelWeights>(dsv4::random_weights(config, topology, 1, false));
  auto engine = dsv4::Engine::create(config, weights, {.backend = dsv4::Backend::cpu,
                                                       .precision = dsv4::Precision::reference,
                                                       .kv_format = "v4.1-native",
                                                       .max_sequences = 8,
                                                       .max_context = 4096});
  dsv4::SequenceId a = engine->add_sequence(), b = engine->add_sequence();
  const int64_t tokens = 38, hidden = config.hidden_size;
  std::vector<float> x(tokens * hidden, 0.5f), y(tokens * hidden);
  auto in = dsv4::TensorView::contiguous(x.data(), dsv4::DType::f32, {tokens, hidden});
  auto out = dsv4::TensorView::contiguous(y.data(), dsv4::DType::f32, {tokens, hidden});
  engine->begin_step({{a, 37}, {b, 1}});
  for (int l = 0; l < topology.size(); ++l) engine->run_layer(l, in, out);
  engine->end_step();
  engine->release_sequence(a);
  std::printf("ok %g\n", y[0]);
}
