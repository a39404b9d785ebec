// Tensor parallelism of the commands that drive an engine (run, bench; docs/parallel.md): the
// --tp flags, the launcher that starts one process per rank, and a rank's communicator.
//
// `dsv4 <command> --tp N` (N > 1) starts N copies of itself with the same arguments plus the
// internal flags --rank r --nccl-id-file F; rank r runs on GPU r, rank 0 prints the results, and
// the launcher exits 0 only when every rank did.
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "dsv4/parallel.h"
#include "parallel/nccl_communicator.h"

namespace dsv4::cli {

struct TensorParallelFlags {
  int tp = 1;
  std::string indexer = "replicated";
  int rank = -1;             // internal: set in the rank processes the launcher starts
  std::string nccl_id_file;  // internal

  // Adds --tp and --tp-indexer, and the internal --rank and --nccl-id-file (not in --help).
  void add_to(CLI::App& app);
  // Whether this is the process the user started with --tp N > 1, which only launches the ranks.
  bool launches() const { return tp > 1 && rank < 0; }
  IndexerSharding indexer_sharding() const { return parse_indexer_sharding(indexer); }
};

// Starts flags.tp copies of this binary (its arguments plus --rank r --nccl-id-file F in a fresh
// temporary directory), waits for them and returns 0 when every rank exited 0, else 1. When a rank
// fails, the others still running 10 s later are killed: they would wait for it in a collective
// forever. Checks first that this binary has CUDA and NCCL and that flags.tp GPUs are present.
int launch_ranks(const TensorParallelFlags& flags, const std::string& command);

// In a rank process: joins the group on GPU `rank` (made current) and returns the communicator;
// nullptr when the command runs without tensor parallelism (--tp 1).
std::shared_ptr<NcclCommunicator> join_rank_group(const TensorParallelFlags& flags, const std::string& command);

}  // namespace dsv4::cli
