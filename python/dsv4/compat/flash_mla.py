"""FlashMLA's Python API for the DeepSeek V4 sparse path, computed by dsv4: a two-line swap for
vLLM / SGLang code that calls ``flash_mla``::

    # from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    from dsv4.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata

Semantics (FlashMLA's documented ones, SPEC §5 and §7):

* ``k_cache`` / ``extra_k_cache``: pages of one format, recognised by the bytes per token (the
  last dimension): 584 ``fp8_ds_mla`` (V4.0 rows: 448 e4m3 + 64 bf16 RoPE + 7 ue8m0 + pad), 528
  V4.1 fp8 (``v41_fp8``), 288 V4.1 fp4 (``v41_fp4``); or plain bf16 / float32 rows (last dim 512).
  Shape ``[num_blocks, page_block_size, 1, bytes]``; block b starts at ``b * k_cache.stride(0)``.
  Pages are *segregated* by default (vLLM and its FlashMLA fork: a page's data rows, then its
  scale rows, then padding to the format's alignment) — ``set_page_placement("interleaved")``
  switches to deepseek-ai FlashMLA's V4.1 records ``[data | scales]`` per token.
* ``indices`` / ``extra_indices_in_kvcache`` ``[b, s_q, topk]`` int32: flat slots
  ``block * page_block_size + offset``; ``-1`` is invalid; only the first ``topk_length[i]`` /
  ``extra_topk_length[i]`` entries of batch row i count when given.
* ``attn_sink [h_q]`` float32 scales the output by ``exp(lse) / (exp(lse) + exp(sink))`` and does
  not change ``lse``; ``lse`` is the natural-log log-sum-exp of the scaled logits, ``[b, h_q, s_q]``
  (``+inf`` and a zero output for a query with no valid index).
* ``out`` is bfloat16 ``[b, s_q, h_q, head_dim_v]``.

The computation is torch.ops.dsv4.paged_sparse_attention (bf16 rows: sparse_attention) on the
tensors' device: dsv4's CUDA kernels on torch's current stream for CUDA tensors, reading the pages
in place (no host copy, no synchronization, capturable in a CUDA graph), the CPU reference
otherwise. As in FlashMLA's kernels, exp-scores are rounded to bf16 before they weight the rows.
With ``extra_k_cache`` the two index sets are attended separately and merged through their
log-sum-exps, the sink applied once to the merged result.
"""

import dataclasses
from typing import Optional, Tuple

import torch

from .. import torch_ops  # noqa: F401  (registers torch.ops.dsv4)
from ..ops import kv_page_geometry

_FORMAT_BY_ROW_BYTES = {584: "fp8_ds_mla", 528: "v41_fp8", 288: "v41_fp4"}
_placement = "segregated"


def set_page_placement(placement):
    """"segregated" (vLLM, the default) or "interleaved" (deepseek-ai FlashMLA's V4.1 records)."""
    global _placement
    if placement not in ("segregated", "interleaved"):
        raise ValueError(f"dsv4: flash_mla: placement '{placement}': expected 'segregated' or 'interleaved'")
    _placement = placement


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's tile-scheduler metadata; dsv4 needs none, so this only records the first call's
    shapes (as FlashMLA does) to catch a reuse with other shapes."""
    have_initialized: bool = False
    config: Optional[tuple] = None


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """Any of FlashMLA's get_mla_metadata signatures; returns (FlashMLASchedMeta(), None)."""
    return FlashMLASchedMeta(), None


def _cache_format(k_cache, name):
    """The dsv4 row format of a FlashMLA cache argument ("rows" for bf16 / fp16 / fp32 rows)."""
    if k_cache.dim() != 4 or k_cache.shape[2] != 1:
        raise ValueError(f"dsv4: flash_mla: {name} has shape {list(k_cache.shape)}, expected "
                         "[num_blocks, page_block_size, 1, bytes_per_token] (one shared KV head)")
    row = k_cache.shape[3]
    if k_cache.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return "rows"
    if k_cache.element_size() != 1 or row not in _FORMAT_BY_ROW_BYTES:
        raise ValueError(f"dsv4: flash_mla: {name} has {row} bytes per token of dtype {k_cache.dtype}, expected "
                         "584 (fp8_ds_mla), 528 (V4.1 fp8) or 288 (V4.1 fp4) bytes, or bf16 rows")
    return _FORMAT_BY_ROW_BYTES[row]


def _attend(q, k_cache, indices, lengths, sink, scale, name):
    """(out [T, H, 512] float32, lse [T, H]) of q [T, H, 512] over k_cache's rows at the flat slots
    indices [T, K] (the first lengths[t] of them when given)."""
    fmt = _cache_format(k_cache, name)
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    if fmt == "rows":
        rows = k_cache.reshape(num_blocks * block_size, k_cache.shape[3]).to(torch.bfloat16)
        return torch.ops.dsv4.sparse_attention(q, rows, indices, lengths, sink, scale, True)
    geometry = kv_page_geometry(fmt, 512, block_size, _placement)
    stride = k_cache.stride(0)
    if stride != geometry["page_stride"]:
        raise ValueError(f"dsv4: flash_mla: {name}: blocks are {stride} bytes apart, but {_placement} {fmt} pages "
                         f"of {block_size} tokens are {geometry['page_stride']} bytes (set_page_placement?)")
    raw = k_cache.view(torch.uint8) if k_cache.dtype != torch.uint8 else k_cache
    # The blocks as whole pages, in place: [num_blocks, page_stride] bytes from the first block.
    pages = torch.as_strided(raw, (num_blocks, stride), (stride, 1), raw.storage_offset())
    return torch.ops.dsv4.paged_sparse_attention(q, pages, fmt, block_size, _placement, 1.0, indices, lengths, sink,
                                                 scale, True)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode attention over paged caches (see the module's docstring). q [b, s_q, h_q, 512];
    returns (out [b, s_q, h_q, head_dim_v] bf16, lse [b, h_q, s_q] float32)."""
    if indices is None:
        raise NotImplementedError("dsv4: flash_mla: only the sparse path (indices given) is implemented")
    if causal:
        raise ValueError("dsv4: flash_mla: causal must be False with sparse attention")
    if head_dim_v != 512 or q.shape[-1] != 512:
        raise ValueError(f"dsv4: flash_mla: head dims {q.shape[-1]} / {head_dim_v}, expected 512 / 512 (V4)")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("dsv4: flash_mla: extra_k_cache and extra_indices_in_kvcache go together")
    meta = tile_scheduler_metadata
    shapes = (tuple(q.shape), k_cache.shape[1], indices.shape[-1],
              None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1])
    if isinstance(meta, FlashMLASchedMeta):
        if meta.have_initialized and meta.config != shapes:
            raise ValueError(f"dsv4: flash_mla: tile_scheduler_metadata was made for {meta.config}, "
                             f"reused for {shapes}")
        meta.have_initialized, meta.config = True, shapes
    b, s_q, h_q, d = q.shape
    scale = float(softmax_scale if softmax_scale is not None else d ** -0.5)
    per_token = lambda x: None if x is None else x.to(torch.int32).repeat_interleave(s_q)  # [b] -> [b * s_q]
    qf = q.reshape(b * s_q, h_q, d)
    sink = None if attn_sink is None else attn_sink.float()
    main = indices.reshape(b * s_q, -1).to(torch.int32)
    if extra_k_cache is None:
        out, lse = _attend(qf, k_cache, main, per_token(topk_length), sink, scale, "k_cache")
    else:
        # Each set without the sink, merged by weight exp(lse_i - lse), the sink applied once.
        extra = extra_indices_in_kvcache.reshape(b * s_q, -1).to(torch.int32)
        out1, lse1 = _attend(qf, k_cache, main, per_token(topk_length), None, scale, "k_cache")
        out2, lse2 = _attend(qf, extra_k_cache, extra, per_token(extra_topk_length), None, scale, "extra_k_cache")
        lse = torch.logaddexp(lse1, lse2)
        empty = torch.isneginf(lse)
        safe = torch.where(empty, torch.zeros_like(lse), lse)
        w1 = torch.where(empty, torch.zeros_like(lse), torch.exp(lse1 - safe))
        w2 = torch.where(empty, torch.zeros_like(lse), torch.exp(lse2 - safe))
        out = out1 * w1[..., None] + out2 * w2[..., None]
        if sink is not None:  # exp(lse) / (exp(lse) + exp(sink))
            out = out * torch.sigmoid(safe - sink[None, :])[..., None]
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    out = out.reshape(b, s_q, h_q, d).to(torch.bfloat16)
    return out, lse.reshape(b, s_q, h_q).transpose(1, 2).contiguous()


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill attention: q [s_q, h_q, 512], kv [s_kv, 1, 512] (bf16 rows), indices
    [s_q, 1, topk] (-1 or >= s_kv: invalid), topk_length [s_q] or None. Returns (out [s_q, h_q, d_v]
    bf16, max_logits [s_q, h_q], lse [s_q, h_q]) — max_logits −inf and lse +inf for a query with no
    valid index; the sink changes out only."""
    if d_v != 512 or q.shape[-1] != 512 or kv.dim() != 3 or kv.shape[1] != 1:
        raise ValueError(f"dsv4: flash_mla_sparse_fwd: q {list(q.shape)}, kv {list(kv.shape)}, d_v {d_v}: "
                         "expected d_qk = d_v = 512 and one KV head")
    s_q, h_q, d = q.shape
    rows = kv.reshape(kv.shape[0], d).to(torch.bfloat16)
    ind = indices.reshape(s_q, -1).to(torch.int32)
    ind = torch.where((ind >= 0) & (ind < rows.shape[0]), ind, torch.full_like(ind, -1))
    lengths = None if topk_length is None else topk_length.to(torch.int32)
    sink = None if attn_sink is None else attn_sink.float()
    out, lse = torch.ops.dsv4.sparse_attention(q, rows, ind, lengths, sink, float(sm_scale), True)
    if lengths is not None:
        positions = torch.arange(ind.shape[1], device=ind.device)
        ind = torch.where(positions[None, :] < lengths[:, None].long(), ind, torch.full_like(ind, -1))
    # max_logits: the largest scaled logit over the valid indices of each query and head, a chunk
    # of queries at a time (the gathered rows of a whole prefill would not fit).
    max_logits = torch.full((s_q, h_q), float("-inf"), device=q.device)
    for first in range(0, s_q, 64):
        chunk = ind[first:first + 64]
        logits = torch.einsum("thd,tkd->thk", q[first:first + 64].float(), rows[chunk.clamp(min=0).long()].float())
        logits = logits.masked_fill((chunk < 0)[:, None, :], float("-inf")) * sm_scale
        if chunk.shape[1]:
            max_logits[first:first + 64] = logits.max(dim=-1).values
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return out.to(torch.bfloat16), max_logits, lse
