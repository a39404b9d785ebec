// The Hopper warpgroup-MMA implementation of run_sparse_attention ("wgmma", kernel in
// sparse_attention_wgmma_kernel.cuh): one block of three warpgroups per (token, 64 heads) and SM,
// rows split over the blocks of a cluster so that a small step still fills one wave of an H100 / H200
// (plan_split_kv_clusters), merged in the cluster, the heads in narrower groups where that merges less.
// The kernels are instantiated in src/cuda/instantiations/sparse_attention_wgmma_*.cu.
#include <string>
#include <type_traits>

#include "cuda/ops/attention/sparse_attention_implementations.h"
#include "cuda/ops/attention/wgmma/sparse_attention_wgmma_kernel.cuh"
#include "dsv4/kv_format.h"

namespace dsv4::cuda {

#define DSV4_WGMMA_ATTENTION(Out, Window, Compressed) \
  extern template void launch_sparse_attention_wgmma<Out, KvRowFormat::Window, KvRowFormat::Compressed>( \
      SparseAttentionLaunch, int64_t, bool, cudaStream_t);
DSV4_WGMMA_ATTENTION(uint16_t, v41_fp8, v41_fp4)
DSV4_WGMMA_ATTENTION(float, v41_fp8, v41_fp4)
DSV4_WGMMA_ATTENTION(uint16_t, fp8_ds_mla, fp8_ds_mla)
DSV4_WGMMA_ATTENTION(float, fp8_ds_mla, fp8_ds_mla)
DSV4_WGMMA_ATTENTION(uint16_t, bf16, bf16)
DSV4_WGMMA_ATTENTION(float, bf16, bf16)
#undef DSV4_WGMMA_ATTENTION

namespace {

using attention_wgmma::kHeadDim;

// One block per SM (the accumulators of 64 heads x 512 channels take half the register file); a
// token's split blocks merge in their cluster.
constexpr AttentionBlocking kBlocking{.heads_per_block = attention_wgmma::kHeadsPerBlock,
                                      .tile_rows = attention_wgmma::kTileRows, .head_dim = kHeadDim,
                                      .one_block_per_sm = true, .merges_in_cluster = true};

// The format pairs the kernel is built for: the V4.1 native caches and FlashMLA's fp8_ds_mla rows
// for both (decoded exactly to bf16: e4m3 codes times ue8m0 scales, e2m1 codes times e4m3 scales),
// and bf16 rows for both (copied straight into the tiles). Other pairs go to decode_mma.
enum class FormatPair { v41_native, fp8_ds_mla, bf16, other };

FormatPair format_pair(const SparseAttentionParams& p) {
  const bool window = is_present(p.window.pages), compressed = is_present(p.compressed.pages);
  auto is = [](const PagedCache& c, KvRowFormat f) { return c.geometry.format == f; };
  auto both = [&](KvRowFormat w, KvRowFormat c) {
    return (!window || is(p.window, w)) && (!compressed || is(p.compressed, c));
  };
  if (both(KvRowFormat::v41_fp8, KvRowFormat::v41_fp4)) return FormatPair::v41_native;
  if (both(KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla)) return FormatPair::fp8_ds_mla;
  if (both(KvRowFormat::bf16, KvRowFormat::bf16)) return FormatPair::bf16;
  return FormatPair::other;
}

constexpr KvRowFormat kFormats[] = {KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, KvRowFormat::fp8_ds_mla,
                                    KvRowFormat::bf16};

using Native = attention_wgmma::Ring<KvRowFormat::v41_fp8, KvRowFormat::v41_fp4>;
using DsMla = attention_wgmma::Ring<KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla>;
using Bf16Rows = attention_wgmma::Ring<KvRowFormat::bf16, KvRowFormat::bf16>;

// sm_90a machine code only (wgmma, setmaxnreg).
std::string supports(const SparseAttentionParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability(90, device); !why_not.empty()) return why_not;
  const FormatPair pair = format_pair(p);
  const size_t shared = pair == FormatPair::fp8_ds_mla ? DsMla::kSharedBytes
                        : pair == FormatPair::bf16     ? Bf16Rows::kSharedBytes
                                                       : Native::kSharedBytes;
  if (std::string why_not = needs_shared_memory(static_cast<long long>(shared), device); !why_not.empty()) return why_not;
  if (std::string why_not = needs_value("head_dim", kHeadDim, p.q.shape[2]); !why_not.empty()) return why_not;
  if (!p.bf16_rounding) return "needs bf16_rounding (the exp-scores are bf16 on the tensor cores)";
  if (p.q.dtype != DType::bf16) return "needs bf16 q (the tensor cores read q as bf16)";
  // The raw rows are copied 16 bytes at a time where the pair's rows allow (Ring::kCopyBytes).
  const int copy_bytes = pair == FormatPair::fp8_ds_mla ? DsMla::kCopyBytes
                         : pair == FormatPair::bf16     ? Bf16Rows::kCopyBytes
                                                        : Native::kCopyBytes;
  if (std::string why_not = gathered_caches_supported(
          p, kFormats, "expected v41_fp8, v41_fp4, fp8_ds_mla or bf16 rows", copy_bytes);
      !why_not.empty())
    return why_not;
  if (pair == FormatPair::other)
    return "needs window v41_fp8 with compressed v41_fp4, or fp8_ds_mla or bf16 for both";
  return "";
}

void run(const SparseAttentionParams& p, void* workspace, cudaStream_t stream) {
  if (p.q.shape[0] == 0 || p.q.shape[1] == 0) return;
  // The launch plans the split (kBlocking.merges_in_cluster).
  const SparseAttentionLaunch a = make_sparse_attention_launch(p, SplitKvPlan{}, nullptr, kHeadDim);
  const int64_t max_rows = max_attended_rows(p);
  const bool split_allowed = workspace != nullptr;
  auto launch = [&](auto window, auto compressed) {
    constexpr KvRowFormat kWindow = decltype(window)::value, kCompressed = decltype(compressed)::value;
    p.out.dtype == DType::bf16
        ? launch_sparse_attention_wgmma<uint16_t, kWindow, kCompressed>(a, max_rows, split_allowed, stream)
        : launch_sparse_attention_wgmma<float, kWindow, kCompressed>(a, max_rows, split_allowed, stream);
  };
  using F = KvRowFormat;
  switch (format_pair(p)) {
    case FormatPair::v41_native:
      launch(std::integral_constant<F, F::v41_fp8>{}, std::integral_constant<F, F::v41_fp4>{});
      break;
    case FormatPair::fp8_ds_mla:
      launch(std::integral_constant<F, F::fp8_ds_mla>{}, std::integral_constant<F, F::fp8_ds_mla>{});
      break;
    default:  // bf16: supports() took no other pair
      launch(std::integral_constant<F, F::bf16>{}, std::integral_constant<F, F::bf16>{});
      break;
  }
  check_launch("sparse_attention (wgmma)");
}

}  // namespace

const SparseAttentionImplementation kSparseAttentionWgmma = {"wgmma", &supports, kBlocking, &run};

}  // namespace dsv4::cuda
