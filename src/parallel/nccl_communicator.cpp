#include "parallel/nccl_communicator.h"

#include "dsv4/error.h"

#if defined(DSV4_WITH_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <thread>

#include "dsv4/cuda/runtime.h"
#endif

namespace dsv4 {

#if defined(DSV4_WITH_NCCL)

namespace {

void check_nccl(ncclResult_t result, const char* what, ncclComm_t comm = nullptr) {
  if (result == ncclSuccess) return;
  const char* detail = ncclGetLastError(comm);
  fail("tensor parallel: ", what, " failed: ", ncclGetErrorString(result),
       detail != nullptr && detail[0] != '\0' ? std::string(" (") + detail + ")" : std::string());
}

// Set before any communicator exists: no NVLink multicast (NVLS), and every connection made when
// the communicator is created rather than at a collective's first use, which may be inside a
// CUDA graph capture (dsv4 bench --op layer captures run_layer with its all-reduces).
void configure_nccl_environment() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("NCCL_RUNTIME_CONNECT", "0", 0);
}

void check_device(const char* operation, int device) {
  const int devices = cuda::device_count();
  DSV4_CHECK(device >= 0 && device < devices, "tensor parallel: ", operation, ": device ", device,
             " does not exist (", devices, " CUDA devices are present)");
}

void write_id_file(const std::string& path, const ncclUniqueId& id) {
  DSV4_CHECK(!std::filesystem::exists(path), "tensor parallel: NCCL id file '", path,
             "' already exists (left from an earlier run?); rank 0 writes a new one there");
  const std::string temporary = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(temporary, std::ios::binary);
    out.write(id.internal, sizeof id.internal);
    DSV4_CHECK(out.good(), "tensor parallel: cannot write the NCCL id file '", temporary, "'");
  }
  // Renaming is atomic: a waiting rank sees no file or the whole id.
  DSV4_CHECK(std::rename(temporary.c_str(), path.c_str()) == 0, "tensor parallel: cannot rename '", temporary,
             "' to '", path, "'");
}

ncclUniqueId read_id_file(const std::string& path, int rank, double timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  while (!std::filesystem::exists(path)) {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    DSV4_CHECK(waited < timeout_s, "tensor parallel: rank ", rank, " waited ", timeout_s,
               " s for the NCCL id file '", path, "' that rank 0 writes; did rank 0 start (and fail)?");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ncclUniqueId id;
  std::ifstream in(path, std::ios::binary);
  in.read(id.internal, sizeof id.internal);
  DSV4_CHECK(in.gcount() == static_cast<std::streamsize>(sizeof id.internal) && in.peek() == EOF,
             "tensor parallel: NCCL id file '", path, "' does not hold exactly ", sizeof id.internal,
             " bytes (an ncclUniqueId)");
  return id;
}

}  // namespace

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, device = 0;
  cudaStream_t check_stream = nullptr;
  uint64_t* check_buffer = nullptr;  // [2] on the device
  int uncaught_at_creation = std::uncaught_exceptions();

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  // Finalizing and destroying a communicator waits for the other ranks. A rank that fails (an
  // exception unwinds) leaves NCCL alone instead: its peers may be waiting for it in a collective,
  // and its process is about to end.
  ~State() {
    if (std::uncaught_exceptions() > uncaught_at_creation) return;
    cudaSetDevice(device);
    if (comm != nullptr) {
      ncclCommFinalize(comm);
      ncclCommDestroy(comm);
    }
    if (check_buffer != nullptr) cudaFree(check_buffer);
    if (check_stream != nullptr) cudaStreamDestroy(check_stream);
  }

  // The stream and buffer of same_on_all_ranks, on the rank's device (made current).
  void create_check_resources() {
    DSV4_CUDA_CHECK(cudaSetDevice(device));
    DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&check_stream, cudaStreamNonBlocking));
    DSV4_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&check_buffer), 2 * sizeof(uint64_t)));
  }
};

bool nccl_available() { return true; }

NcclCommunicator::NcclCommunicator(std::unique_ptr<State> state) : state_(std::move(state)) {}

std::shared_ptr<NcclCommunicator> NcclCommunicator::join_through_file(const std::string& id_file, int rank, int size,
                                                                      int device, double timeout_s) {
  DSV4_CHECK(size >= 1 && rank >= 0 && rank < size, "tensor parallel: join: rank ", rank, " of ", size,
             " ranks, expected 0 <= rank < ranks");
  check_device("join", device);
  configure_nccl_environment();
  DSV4_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  if (rank == 0) {
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    write_id_file(id_file, id);
  } else {
    id = read_id_file(id_file, rank, timeout_s);
  }
  auto state = std::make_unique<State>();
  state->rank = rank;
  state->size = size;
  state->device = device;
  check_nccl(ncclCommInitRank(&state->comm, size, id, rank), "ncclCommInitRank");
  state->create_check_resources();
  return std::shared_ptr<NcclCommunicator>(new NcclCommunicator(std::move(state)));
}

std::vector<std::shared_ptr<NcclCommunicator>> NcclCommunicator::create_local_group(const std::vector<int>& devices) {
  DSV4_CHECK(!devices.empty(), "tensor parallel: create_local_group: no devices given");
  for (int d : devices) check_device("create_local_group", d);
  configure_nccl_environment();
  std::vector<ncclComm_t> comms(devices.size());
  check_nccl(ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()), "ncclCommInitAll");
  int current = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&current));
  std::vector<std::shared_ptr<NcclCommunicator>> group;
  for (size_t r = 0; r < devices.size(); ++r) {
    auto state = std::make_unique<State>();
    state->comm = comms[r];
    state->rank = static_cast<int>(r);
    state->size = static_cast<int>(devices.size());
    state->device = devices[r];
    group.push_back(std::shared_ptr<NcclCommunicator>(new NcclCommunicator(std::move(state))));
  }
  for (const auto& rank : group) rank->state_->create_check_resources();
  DSV4_CUDA_CHECK(cudaSetDevice(current));
  return group;
}

NcclCommunicator::~NcclCommunicator() = default;

int NcclCommunicator::rank() const { return state_->rank; }
int NcclCommunicator::size() const { return state_->size; }
int NcclCommunicator::device() const { return state_->device; }

void NcclCommunicator::all_reduce_sum(float* data, int64_t count, void* stream) {
  DSV4_CHECK(stream != nullptr, "tensor parallel: the NCCL all-reduce sums device memory on the engine's stream; "
             "the cpu backend cannot use it");
  DSV4_CHECK(count >= 0, "tensor parallel: all-reduce of ", count, " floats");
  if (count == 0) return;
  check_nccl(ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclSum, state_->comm,
                           static_cast<cudaStream_t>(stream)),
             "ncclAllReduce", state_->comm);
}

bool NcclCommunicator::same_on_all_ranks(uint64_t value) {
  DSV4_CUDA_CHECK(cudaSetDevice(state_->device));
  // max(value) and max(~value) = ~min(value) in one all-reduce: equal everywhere iff max == min.
  uint64_t host[2] = {value, ~value};
  DSV4_CUDA_CHECK(cudaMemcpyAsync(state_->check_buffer, host, sizeof host, cudaMemcpyHostToDevice, state_->check_stream));
  check_nccl(ncclAllReduce(state_->check_buffer, state_->check_buffer, 2, ncclUint64, ncclMax, state_->comm,
                           state_->check_stream),
             "ncclAllReduce (max)", state_->comm);
  DSV4_CUDA_CHECK(cudaMemcpyAsync(host, state_->check_buffer, sizeof host, cudaMemcpyDeviceToHost, state_->check_stream));
  DSV4_CUDA_CHECK(cudaStreamSynchronize(state_->check_stream));
  return host[0] == ~host[1];
}

#else  // built without NCCL

struct NcclCommunicator::State {};

namespace {
[[noreturn]] void no_nccl(const char* operation) {
  fail("tensor parallel: ", operation, ": this binary was built without NCCL (a CUDA build finds it in "
       "/usr/local/cuda: include/nccl.h and lib64/libnccl.so)");
}
}  // namespace

bool nccl_available() { return false; }
NcclCommunicator::NcclCommunicator(std::unique_ptr<State> state) : state_(std::move(state)) {}
std::shared_ptr<NcclCommunicator> NcclCommunicator::join_through_file(const std::string&, int, int, int, double) {
  no_nccl("join");
}
std::vector<std::shared_ptr<NcclCommunicator>> NcclCommunicator::create_local_group(const std::vector<int>&) {
  no_nccl("create_local_group");
}
NcclCommunicator::~NcclCommunicator() = default;
int NcclCommunicator::rank() const { return 0; }
int NcclCommunicator::size() const { return 1; }
int NcclCommunicator::device() const { return 0; }
void NcclCommunicator::all_reduce_sum(float*, int64_t, void*) { no_nccl("all_reduce_sum"); }
bool NcclCommunicator::same_on_all_ranks(uint64_t) { no_nccl("same_on_all_ranks"); }

#endif

std::shared_ptr<Communicator> make_nccl_communicator(const std::string& id_file, int rank, int size, int device,
                                                     double timeout_s) {
  return NcclCommunicator::join_through_file(id_file, rank, size, device, timeout_s);
}

std::vector<std::shared_ptr<Communicator>> make_local_nccl_group(const std::vector<int>& devices) {
  std::vector<std::shared_ptr<NcclCommunicator>> group = NcclCommunicator::create_local_group(devices);
  return {group.begin(), group.end()};
}

}  // namespace dsv4
