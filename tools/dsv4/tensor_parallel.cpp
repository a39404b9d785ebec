#include "dsv4/tensor_parallel.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

#include "dsv4/backend_util.h"
#include "dsv4/error.h"

#ifdef DSV4_WITH_CUDA
#include "dsv4/cuda/runtime.h"
#endif

namespace dsv4::cli {
namespace {

// How long a rank waits for rank 0's NCCL id (rank 0 writes it right after it starts).
constexpr double kJoinTimeoutSeconds = 120.0;
// How long the other ranks may run on after one failed.
constexpr int kStopAfterFailureSeconds = 10;

int present_gpus() {
#ifdef DSV4_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

// What --tp N needs of this binary and machine.
void check_tensor_parallel_here(const TensorParallelFlags& flags, const std::string& command) {
  DSV4_CHECK(flags.tp >= 1, command, ": --tp is ", flags.tp, ", expected >= 1");
  parse_indexer_sharding(flags.indexer);
  if (flags.tp == 1) return;
  DSV4_CHECK(built_with_cuda(), command, ": --tp ", flags.tp,
             " runs one rank per GPU on the cuda backend; this binary was built without CUDA (configure with "
             "-DDSV4_CUDA=ON)");
  DSV4_CHECK(nccl_available(), command, ": --tp ", flags.tp,
             " needs NCCL for the all-reduces; this binary was built without it (CMake found no nccl.h and "
             "libnccl.so next to CUDA)");
  const int gpus = present_gpus();
  DSV4_CHECK(flags.tp <= gpus, command, ": --tp ", flags.tp, " needs ", flags.tp, " GPUs (one per rank), ", gpus,
             " are present");
}

// This process's arguments as it was started (argv[0] first).
std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  DSV4_CHECK(!all.empty(), "tensor parallel: cannot read /proc/self/cmdline to start the ranks");
  std::vector<std::string> args;
  for (size_t start = 0; start < all.size();) {
    const size_t end = all.find('\0', start);
    args.push_back(all.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return args;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "was killed by signal " + std::to_string(WTERMSIG(status));
  return "stopped";
}

}  // namespace

void TensorParallelFlags::add_to(CLI::App& app) {
  app.add_option("--tp", tp, "Tensor-parallel ranks: one process and GPU each, NCCL all-reduces (cuda backend)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--tp-indexer", indexer,
                 "With --tp: replicated (every rank runs the whole indexer) or split (each rank scores its share "
                 "of the index heads, the scores are all-reduced)")
      ->capture_default_str()
      ->check(CLI::IsMember({"replicated", "split"}));
  // Internal: set by the launcher for the rank processes; an empty group hides them from --help.
  app.add_option("--rank", rank, "Rank of this process (internal)")->group("");
  app.add_option("--nccl-id-file", nccl_id_file, "File with the group's NCCL id (internal)")->group("");
}

int launch_ranks(const TensorParallelFlags& flags, const std::string& command) {
  check_tensor_parallel_here(flags, command);
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // no NVLink multicast, in every rank
  std::string dir = (std::filesystem::temp_directory_path() / "dsv4-tp-XXXXXX").string();
  DSV4_CHECK(mkdtemp(dir.data()) != nullptr, command, ": cannot create a temporary directory for the NCCL id (",
             dir, ")");
  const std::string id_file = dir + "/nccl-id";
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::vector<std::string> base = own_arguments();

  std::vector<pid_t> ranks;
  std::vector<bool> running;
  const auto stop_running = [&] {
    for (size_t r = 0; r < ranks.size(); ++r)
      if (running[r]) kill(ranks[r], SIGKILL);
  };
  for (int r = 0; r < flags.tp; ++r) {
    std::vector<std::string> args = base;
    args.insert(args.end(), {"--rank", std::to_string(r), "--nccl-id-file", id_file});
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      execv(exe.c_str(), argv.data());
      std::fprintf(stderr, "dsv4: %s: rank %d: cannot start '%s'\n", command.c_str(), r, exe.c_str());
      _exit(127);
    }
    if (pid < 0) {
      stop_running();
      fail(command, ": cannot start rank ", r, " (fork failed)");
    }
    ranks.push_back(pid);
    running.push_back(true);
  }

  // A failed rank may leave the others waiting for it in a collective forever; they get a few
  // seconds to end by themselves (they may be reporting the same failure), then are stopped.
  int exit_code = 0;
  bool stopped = false;
  auto failed_at = std::chrono::steady_clock::now();
  for (size_t left = ranks.size(); left > 0;) {
    int status = 0;
    const bool grace = exit_code != 0 && !stopped;
    const pid_t pid = waitpid(-1, &status, grace ? WNOHANG : 0);
    if (pid == 0) {  // in the grace period, no rank ended
      if (std::chrono::steady_clock::now() - failed_at > std::chrono::seconds(kStopAfterFailureSeconds)) {
        std::fprintf(stderr, "dsv4: %s: stopping the ranks still running\n", command.c_str());
        stop_running();
        stopped = true;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      continue;
    }
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (ranks[r] != pid || !running[r]) continue;
      running[r] = false;
      --left;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) break;
      if (exit_code == 0) failed_at = std::chrono::steady_clock::now();
      exit_code = 1;
      if (!stopped)
        std::fprintf(stderr, "dsv4: %s: rank %zu %s\n", command.c_str(), r, describe_status(status).c_str());
      break;
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return exit_code;
}

std::shared_ptr<NcclCommunicator> join_rank_group(const TensorParallelFlags& flags, const std::string& command) {
  DSV4_CHECK(!flags.launches(), command, ": internal: --tp ", flags.tp, " must launch its ranks first");
  if (flags.rank < 0) {
    check_tensor_parallel_here(flags, command);
    return nullptr;
  }
  DSV4_CHECK(flags.tp > 1 && flags.rank < flags.tp && !flags.nccl_id_file.empty(), command, ": --rank ", flags.rank,
             " and --nccl-id-file are set by a --tp N launch (N > 1, rank < N); --tp is ", flags.tp);
  check_tensor_parallel_here(flags, command);
  return NcclCommunicator::join_through_file(flags.nccl_id_file, flags.rank, flags.tp, flags.rank, kJoinTimeoutSeconds);
}

}  // namespace dsv4::cli
