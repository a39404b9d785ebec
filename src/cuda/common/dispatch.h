// The dispatch seam of the CUDA ops: an op has a list of implementations (the portable SIMT one
// last), each declaring what it supports; one chooser per op takes the first implementation that
// supports the call. Host-only and free of CUDA calls except device_info(), so that the choice
// can be tested without a GPU.
//
// An op's implementation entry is a struct with at least
//   const char* name;                                                   // e.g. "simt"
//   std::string (*supports)(const Params&, const DeviceInfo&);          // "" or why not
// plus the op's run (and workspace size) function pointers.
#pragma once

#include <span>
#include <string>

#include "dsv4/error.h"

namespace dsv4::cuda {

// What implementations check about the device a call runs on.
struct DeviceInfo {
  int compute_capability = 0;  // major * 10 + minor: 80 (A100), 90 (H100 / H200: sm_90a code runs only here)
  int max_shared_bytes_per_block = 0;  // with opt-in: 232448 on H100 / H200, 166912 on A100, 101376 on Ada
  int max_shared_bytes_per_sm = 0;     // 233472 on H100 / H200
  int multiprocessors = 0;             // 132 on H100 SXM / H200
  int ordinal = -1;                    // the CUDA device it describes (last: tests spell the others)
};

// The current device's info, queried once per device and cached.
const DeviceInfo& device_info();

// The first of `implementations` whose supports() returns "" for the call; none: throws
// "dsv4: <op>: no implementation supports this call: <name>: <reason>; <name>: <reason>".
template <class Entry, class Params>
const Entry& choose_implementation(const char* op, std::span<const Entry* const> implementations, const Params& p,
                                   const DeviceInfo& device) {
  std::string reasons;
  for (const Entry* implementation : implementations) {
    const std::string why_not = implementation->supports(p, device);
    if (why_not.empty()) return *implementation;
    reasons += (reasons.empty() ? "" : "; ") + std::string(implementation->name) + ": " + why_not;
  }
  fail(op, ": no implementation supports this call: ", reasons.empty() ? "there are none" : reasons);
}

// Reasons, in the words every implementation uses.
std::string needs_compute_capability(int needed, const DeviceInfo& device);           // "" when exactly `needed`
std::string needs_compute_capability_at_least(int needed, const DeviceInfo& device);  // "" when >= `needed`
std::string needs_value(const char* what, long long needed, long long given);  // "" when equal
std::string needs_shared_memory(long long bytes, const DeviceInfo& device);      // "" when the block fits

}  // namespace dsv4::cuda
