"""Single operations of the attention layer on numpy arrays or torch tensors, through the C API:
on the CPU the reference, on a CUDA device the CUDA kernels, queued on torch's current stream
(no synchronization, capturable in a CUDA graph). Inputs are made contiguous; float inputs are
float32 (or bfloat16 where noted; a DTypeError names the argument otherwise). Outputs are
allocated like the first input (numpy or torch, on its device). torch users get the same
operations as torch.ops.dsv4.*."""

import math

import numpy as np

from . import _dsv4
from ._tensors import as_index, capsule, contiguous, empty_like, on_cuda, stream_of

FORMATS = ("bf16", "fp8_per_tensor", "v41_fp8", "v41_fp4", "fp8_ds_mla", "index_mxfp4", "index_fp8", "f32")


def kv_page_geometry(format, dims=512, rows_per_page=0, placement="segregated"):
    """{"dims", "rows_per_page", "page_stride", "row_bytes", "data_bytes", "scale_bytes"} of a KV row
    format's pages (rows_per_page 0: the format's default; placement "segregated" (vLLM) or
    "interleaved" (deepseek-ai FlashMLA's V4.1 records))."""
    return _dsv4.kv_page_geometry(format, dims, rows_per_page, placement)


def kv_alloc_pages(format, num_pages, dims=512, rows_per_page=0, placement="segregated", like=None):
    """Zeroed pages [num_pages, page_stride] uint8 for the format."""
    g = kv_page_geometry(format, dims, rows_per_page, placement)
    out = empty_like(like, (num_pages, g["page_stride"]), np.uint8)
    out[...] = 0
    return out


def kv_encode(format, x, slots, pages, rows_per_page=0, placement="segregated", tensor_scale=1.0,
              fp8_scale_floor="amax"):
    """Encodes x [n, dims] float32 into pages [num_pages, page_stride] uint8 (in place) at slots [n]
    (slot = page * rows_per_page + row; -1: skipped). Returns pages."""
    x = contiguous(x)
    rpp = rows_per_page or kv_page_geometry(format, x.shape[1])["rows_per_page"]
    _dsv4.kv_encode(format, rpp, placement, capsule(x), capsule(as_index(slots, x, np.int64)), capsule(pages),
                    float(tensor_scale), fp8_scale_floor, stream_of(x))
    return pages


def kv_decode(format, pages, slots, dims=512, rows_per_page=0, placement="segregated", tensor_scale=1.0, out=None):
    """Decodes rows [n, dims] float32 from pages at slots [n] (-1: a row of zeros)."""
    pages = contiguous(pages)
    slots = as_index(slots, pages, np.int64)
    rpp = rows_per_page or kv_page_geometry(format, dims)["rows_per_page"]
    if out is None:
        out = empty_like(pages, (slots.shape[0], dims), np.float32)
    _dsv4.kv_decode(format, rpp, placement, capsule(pages), capsule(slots), capsule(out), float(tensor_scale),
                    stream_of(pages))
    return out


def _bf16_on_cuda(x):
    """The CUDA kernels read q, kv and index queries / keys as bfloat16 (the model's dtype)."""
    import torch
    return x.to(torch.bfloat16).contiguous() if on_cuda(x) else x


def sparse_attention(q, kv, indices, sink=None, scale=None, topk_length=None, bf16=False, return_lse=False):
    """Sparse MQA attention with a per-head sink (SPEC §5.2). q [T, H, D], kv [N, D] (key = value),
    indices [T, K] (rows of kv; -1 and positions >= topk_length[t] skipped), sink [H] or None.
    scale: D ** -0.5 when None. bf16: the reference kernel's rounding of the exp-scores. On CUDA, q
    and kv are read as bfloat16 and D is 512. Returns out [T, H, D] float32 (and lse [T, H],
    log-sum-exp of the scaled logits without the sink, with return_lse)."""
    q, kv, sink = _bf16_on_cuda(contiguous(q)), _bf16_on_cuda(contiguous(kv)), contiguous(sink)
    indices = as_index(indices, q, np.int32)
    topk_length = as_index(topk_length, q, np.int32)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out = empty_like(q, q.shape, np.float32)
    lse = empty_like(q, q.shape[:2], np.float32) if return_lse else None
    _dsv4.sparse_attention(capsule(q), capsule(kv), capsule(indices), capsule(topk_length), capsule(sink),
                           float(scale), bool(bf16), capsule(out), capsule(lse), stream_of(q))
    return (out, lse) if return_lse else out


def paged_sparse_attention(q, pages, format, indices, rows_per_page=0, placement="segregated", sink=None,
                           scale=None, topk_length=None, bf16=False, tensor_scale=1.0, return_lse=False):
    """sparse_attention over the rows of paged caches in their byte format (pages [num_pages,
    page_stride] uint8, as kv_alloc_pages makes them); indices [T, K] are flat slots
    page * rows_per_page + row (FlashMLA's), -1 invalid. D = 512."""
    q, pages, sink = _bf16_on_cuda(contiguous(q)), contiguous(pages), contiguous(sink)
    indices = as_index(indices, q, np.int32)
    topk_length = as_index(topk_length, q, np.int32)
    rpp = rows_per_page or kv_page_geometry(format, q.shape[-1])["rows_per_page"]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out = empty_like(q, q.shape, np.float32)
    lse = empty_like(q, q.shape[:2], np.float32) if return_lse else None
    _dsv4.paged_sparse_attention(capsule(q), format, rpp, placement, capsule(pages), float(tensor_scale),
                                 capsule(indices), capsule(topk_length), capsule(sink), float(scale), bool(bf16),
                                 capsule(out), capsule(lse), stream_of(q))
    return (out, lse) if return_lse else out


def _positions(n_visible, like, n):
    """token_position [T] int32 with n_visible(t) = position + 1 (compress ratio 1); None: all n."""
    if n_visible is None:
        n_visible = [n] * like.shape[0]
    return as_index(n_visible, like, np.int64) - 1


def index_scores(q, weights, keys, n_visible=None, bf16=False):
    """Lightning-indexer scores (SPEC §4): q [T, H, D], weights [T, H], keys [N, D]; scores [T, N] =
    Σ_h weights[t,h]·relu(q[t,h]·keys[j]) for j < n_visible[t] (default N), −inf beyond. On CUDA, q
    and keys are read as bfloat16."""
    q, weights, keys = _bf16_on_cuda(contiguous(q)), contiguous(weights), _bf16_on_cuda(contiguous(keys))
    positions = as_index(_positions(n_visible, q, keys.shape[0]), q, np.int32)
    scores = empty_like(q, (q.shape[0], keys.shape[0]), np.float32)
    _dsv4.index_scores(capsule(q), capsule(weights), capsule(keys), capsule(positions), 1, bool(bf16),
                       capsule(scores), stream_of(q))
    return scores


def topk(scores, k, n_visible=None):
    """Top-k picks (SPEC §4.6): scores [T, N] → [T, k] int32, the k best of the first n_visible[t]
    entries that are not −inf, ascending, padded with −1 (NaN ranks lowest; ties: lower index)."""
    scores = contiguous(scores)
    positions = as_index(_positions(n_visible, scores, scores.shape[1]), scores, np.int32)
    picks = empty_like(scores, (scores.shape[0], k), np.int32)
    _dsv4.topk(capsule(scores), capsule(positions), 1, capsule(picks), stream_of(scores))
    return picks


def compressor_pool(kv, score, bias=None):
    """The compressor's gated pooling (SPEC §3): kv, score [E, S, D], bias [S, D] or None →
    pooled [E, D] = Σ_s softmax_s(score + bias) · kv per channel."""
    kv, score, bias = contiguous(kv), contiguous(score), contiguous(bias)
    pooled = empty_like(kv, (kv.shape[0], kv.shape[2]), np.float32)
    _dsv4.compressor_pool(capsule(kv), capsule(score), capsule(bias), capsule(pooled))
    return pooled
