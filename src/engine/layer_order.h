// The rules every backend applies before a layer runs inside a step (SPEC §1.3): a layer runs once
// per step, needs its weights, and reads only sources that already ran in the same step.
#pragma once

#include <functional>

#include "dsv4/config.h"

namespace dsv4 {

// Throws "dsv4: engine: layer L reads the picks of index source S, which has not run in this step"
// (and the like) when `layer` may not run now. `ran(l)`: whether layer l ran in this step;
// `skipped_by_a_sequence`: whether a sequence of the step missed this layer in an earlier step.
void check_layer_may_run(const ModelConfig& config, const ModelTopology& topology, int layer, bool has_weights,
                         bool skipped_by_a_sequence, const std::function<bool(int)>& ran);

}  // namespace dsv4
