// The chooser of the dispatch seam (src/cuda/common/dispatch.h) with fake implementations: the
// first that supports a call wins, and a call none supports names every reason. Needs no device.
#include <gtest/gtest.h>

#include <string>

#include "cuda/common/dispatch.h"
#include "test_util.h"

namespace dsv4::cuda {
namespace {

struct FakeParams {
  int head_dim = 0;
};

struct FakeImplementation {
  const char* name;
  std::string (*supports)(const FakeParams&, const DeviceInfo&);
};

const FakeImplementation kHopperOnly = {"wgmma", [](const FakeParams& p, const DeviceInfo& device) {
                                          if (std::string why_not = needs_compute_capability(90, device); !why_not.empty())
                                            return why_not;
                                          return needs_value("head_dim", 512, p.head_dim);
                                        }};
const FakeImplementation kAnyHeadDim = {"simt", [](const FakeParams&, const DeviceInfo& device) {
                                          return needs_compute_capability_at_least(80, device);
                                        }};
const FakeImplementation kHeadDim64 = {"small", [](const FakeParams& p, const DeviceInfo&) {
                                         return needs_value("head_dim", 64, p.head_dim);
                                       }};

const char* chosen(std::span<const FakeImplementation* const> list, FakeParams p, int compute_capability) {
  return choose_implementation("fake_op", list, p, DeviceInfo{compute_capability}).name;
}

TEST(DispatchTest, TheFirstImplementationThatSupportsTheCallWins) {
  const FakeImplementation* list[] = {&kHopperOnly, &kAnyHeadDim};
  EXPECT_STREQ(chosen(list, {512}, 90), "wgmma");
  EXPECT_STREQ(chosen(list, {512}, 80), "simt");   // not a Hopper device
  EXPECT_STREQ(chosen(list, {256}, 90), "simt");   // a head size the first does not support
  EXPECT_STREQ(chosen(list, {512}, 100), "simt");  // sm_90a code runs on compute capability 9.0 only
  const FakeImplementation* reversed[] = {&kAnyHeadDim, &kHopperOnly};
  EXPECT_STREQ(chosen(reversed, {512}, 90), "simt");
}

TEST(DispatchTest, NoSupportingImplementationNamesEveryReason) {
  const FakeImplementation* list[] = {&kHopperOnly, &kAnyHeadDim, &kHeadDim64};
  EXPECT_EQ(test::error_of([&] { chosen(list, {512}, 75); }),
            "dsv4: fake_op: no implementation supports this call: wgmma: needs compute capability 9.0, the device has "
            "7.5; simt: needs compute capability >= 8.0, the device has 7.5; small: head_dim 512, supports 64");
  EXPECT_EQ(test::error_of([&] { chosen({}, {512}, 90); }),
            "dsv4: fake_op: no implementation supports this call: there are none");
}

}  // namespace
}  // namespace dsv4::cuda
