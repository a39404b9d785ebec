// The NCCL Communicator of tensor-parallel ranks on the GPUs of one node (docs/parallel.md).
// Built when CMake finds NCCL next to CUDA (DSV4_WITH_NCCL); without it nccl_available() is false
// and creating a communicator throws saying so. Users make one through dsv4/parallel.h's
// make_nccl_communicator / make_local_nccl_group; the tools use this class for same_on_all_ranks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/parallel.h"

namespace dsv4 {

class NcclCommunicator final : public Communicator {
 public:
  // Rank `rank` of `size` ranks, one process each, on CUDA device `device` (made current for the
  // calling thread). The ranks find each other through `id_file`: rank 0 creates the group's NCCL
  // unique id and writes it there (to a temporary file renamed into place, so no rank reads part
  // of an id; the file must not exist yet), the other ranks wait up to `timeout_s` seconds for it.
  // Sets NCCL_NVLS_ENABLE=0 first (no NVLink multicast) and, unless set, NCCL_RUNTIME_CONNECT=0
  // (connections made here, not inside a later CUDA graph capture).
  static std::shared_ptr<NcclCommunicator> join_through_file(const std::string& id_file, int rank, int size, int device,
                                                             double timeout_s);
  // Every rank of a group inside one process, rank r on devices[r] (ncclCommInitAll). Each rank's
  // engine then runs on a thread of its own with the rank's device current, and that thread
  // releases the rank's communicator (destroying one waits for the other ranks to do the same).
  static std::vector<std::shared_ptr<NcclCommunicator>> create_local_group(const std::vector<int>& devices);

  // Finalizes and destroys the NCCL communicator, which waits for the other ranks; while an
  // exception unwinds (a failed rank) it leaves NCCL alone, so that the rank does not wait for
  // peers that may be waiting for it.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  int device() const;
  // ncclAllReduce (sum, in place) queued on `stream`, the engine's cudaStream_t; `data` is memory
  // of this rank's device. Can be captured into a CUDA graph.
  void all_reduce_sum(float* data, int64_t count, void* stream) override;
  // Whether every rank passed the same `value` (a collective: every rank calls it; waits for the
  // answer). Used to check that the ranks computed identical outputs.
  bool same_on_all_ranks(uint64_t value);

 private:
  struct State;
  explicit NcclCommunicator(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace dsv4
