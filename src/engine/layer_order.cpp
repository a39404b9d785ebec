#include "engine/layer_order.h"

#include "dsv4/error.h"

namespace dsv4 {

void check_layer_may_run(const ModelConfig& config, const ModelTopology& topology, int layer, bool has_weights,
                         bool skipped_by_a_sequence, const std::function<bool(int)>& ran) {
  const LayerPlan& plan = topology[layer];
  DSV4_CHECK(!ran(layer), "engine: run_layer: layer ", layer, " already ran in this step");
  DSV4_CHECK(has_weights, "engine: run_layer: layer ", layer, " (MTP) has no weights in the checkpoint");
  if (plan.kv_source >= 0 && plan.kv_source != layer)
    DSV4_CHECK(ran(plan.kv_source), "engine: layer ", layer, " reads the compressed cache of kv source ",
               plan.kv_source, ", which has not run in this step");
  if (plan.index_source >= 0 && plan.index_source != layer)
    DSV4_CHECK(ran(plan.index_source), "engine: layer ", layer, " reads the picks of index source ", plan.index_source,
               ", which has not run in this step");
  if (plan.uses_candidates)
    DSV4_CHECK(ran(config.candidate_source_layer), "engine: layer ", layer, " applies the candidates of layer ",
               config.candidate_source_layer, ", which has not run in this step");
  DSV4_CHECK(!skipped_by_a_sequence, "engine: run_layer: layer ", layer,
             " did not run in an earlier step of a sequence in this step; its caches of that sequence are incomplete");
}

}  // namespace dsv4
