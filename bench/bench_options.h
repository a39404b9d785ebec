// What dsv4 bench times and how often; free of CUDA so that the command line builds without it.
#pragma once

#include <cstdint>
#include <string>

namespace dsv4::bench {

struct BenchOptions {
  std::string op;
  int64_t batch = 0;    // sequences (0: the op's default)
  int64_t context = 0;  // context tokens per sequence, or the chunk length of chunk ops (0: the op's default)
  std::string kv_format;  // KV format set of the caches the attention and indexer ops read (kv_format_set
                          // names; empty: the op's default)
  int iters = 50;       // timed runs
  int warmup = 5;       // untimed runs before them
};

}  // namespace dsv4::bench
