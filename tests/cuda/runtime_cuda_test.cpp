// The runtime plumbing every op and the engine stand on: host-to-device copies that have landed
// when they return, and the diagnostic fill of new device buffers (landed when they are returned).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "cuda/cuda_test_util.h"

namespace dsv4::cuda {
namespace {

using testing::CudaTest;

// `dsv4 run` once uploaded each layer's inputs with cudaMemcpy from pageable memory and ran the
// layer on the engine's non-blocking stream: cudaMemcpy may return before its last DMA has
// landed, so a layer sometimes read a few stale rows (two identical runs differed at a random
// layer). A kernel-free reader on a non-blocking stream must see every byte of every upload.
TEST_F(CudaTest, CopyToDeviceHasLandedWhenItReturns) {
  constexpr size_t kWords = size_t{48} << 20;  // 192 MiB: many staging chunks
  std::vector<uint32_t> host(kWords), seen(kWords);
  DeviceBuffer target(kWords * 4), mirror(kWords * 4);
  Stream stream;
  for (uint32_t round = 1; round <= 6; ++round) {
    for (size_t i = 0; i < kWords; ++i) host[i] = static_cast<uint32_t>(i) * 2654435761u + round;
    copy_to_device(target.data(), host.data(), kWords * 4, nullptr);
    DSV4_CUDA_CHECK(cudaMemcpyAsync(mirror.data(), target.data(), kWords * 4, cudaMemcpyDeviceToDevice, stream.get()));
    stream.synchronize("copy_to_device test");
    mirror.download(seen.data(), kWords * 4);
    size_t differing = 0, first = kWords;
    for (size_t i = 0; i < kWords; ++i)
      if (seen[i] != host[i]) {
        ++differing;
        if (first == kWords) first = i;
      }
    ASSERT_EQ(differing, 0u) << "round " << round << ": the stream read " << differing
                             << " stale words of the upload, the first at word " << first;
  }
}

TEST_F(CudaTest, AllocationFillFillsNewBuffers) {
  set_allocation_fill(0x5a);
  const DeviceBuffer filled(1000);
  set_allocation_fill(std::nullopt);
  std::vector<uint8_t> bytes(1000);
  filled.download(bytes.data(), bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) ASSERT_EQ(bytes[i], 0x5a) << "byte " << i;
}

// The fill runs on the default stream, which the engines' non-blocking streams are not ordered
// with. determinism_cuda_test failed once in five runs beside another test (ctest -j2): a fill
// the GPU ran late, while the other process held it, overwrote weights that the engine's stream
// had uploaded into the new buffer since. With the default stream held up, a copy on a
// non-blocking stream into a just-filled buffer must survive.
TEST_F(CudaTest, AllocationFillHasLandedWhenTheBufferIsReturned) {
  constexpr size_t kBytes = size_t{8} << 20;
  const std::vector<uint8_t> host(kBytes, 0x11);
  std::vector<uint8_t> seen(kBytes);
  Stream stream;
  set_allocation_fill(0x5a);
  testing::hold_default_stream(std::chrono::milliseconds(300));
  const DeviceBuffer buffer(kBytes);
  set_allocation_fill(std::nullopt);
  copy_to_device(buffer.data(), host.data(), kBytes, stream.get());
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());  // a fill still queued anywhere lands now
  buffer.download(seen.data(), kBytes);
  const auto overwritten = std::count(seen.begin(), seen.end(), uint8_t{0x5a});
  ASSERT_EQ(overwritten, 0) << overwritten << " of " << kBytes << " uploaded bytes were overwritten by the fill";
}

}  // namespace
}  // namespace dsv4::cuda
