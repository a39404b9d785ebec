"""Single operations of the attention layer on numpy arrays or torch CPU tensors: the CPU
reference of the C API. Inputs are made contiguous; float inputs must be float32 (a DTypeError
names the argument otherwise). Outputs are allocated like the first input (numpy or torch).
torch users get the same operations as torch.ops.dsv4.* after ``import dsv4.torch``."""

import math

import numpy as np

from . import _dsv4
from ._tensors import as_index, capsule, contiguous, empty_like

FORMATS = ("bf16", "fp8_per_tensor", "v41_fp8", "v41_fp4", "fp8_ds_mla", "index_mxfp4", "index_fp8")


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
                    float(tensor_scale), fp8_scale_floor)
    return pages


def kv_decode(format, pages, slots, dims=512, rows_per_page=0, placement="segregated", tensor_scale=1.0, out=None):
    """Decodes rows [n, dims] float32 from pages at slots [n] (-1: a row of zeros)."""
    pages = contiguous(pages)
    slots = as_index(slots, pages, np.int64)
    rpp = rows_per_page or kv_page_geometry(format, dims)["rows_per_page"]
    if out is None:
        out = empty_like(pages, (slots.shape[0], dims), np.float32)
    _dsv4.kv_decode(format, rpp, placement, capsule(pages), capsule(slots), capsule(out), float(tensor_scale))
    return out


def sparse_attention(q, kv, indices, sink=None, scale=None, topk_length=None, bf16=False, return_lse=False):
    """Sparse MQA attention with a per-head sink (SPEC §5.2). q [T, H, D], kv [N, D] (key = value),
    indices [T, K] (rows of kv; -1 and positions >= topk_length[t] skipped), sink [H] or None.
    scale: D ** -0.5 when None. Returns out [T, H, D] (and lse [T, H], log-sum-exp of the scaled
    logits without the sink, with return_lse)."""
    q, kv, sink = contiguous(q), contiguous(kv), contiguous(sink)
    indices = as_index(indices, q, np.int32)
    topk_length = as_index(topk_length, q, np.int32)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out = empty_like(q, q.shape, np.float32)
    lse = empty_like(q, q.shape[:2], np.float32) if return_lse else None
    _dsv4.sparse_attention(capsule(q), capsule(kv), capsule(indices), capsule(topk_length), capsule(sink),
                           float(scale), bool(bf16), capsule(out), capsule(lse))
    return (out, lse) if return_lse else out


def index_scores(q, weights, keys, n_visible=None, bf16=False):
    """Lightning-indexer scores (SPEC §4): q [T, H, D], weights [T, H], keys [N, D]; scores [T, N] =
    Σ_h weights[t,h]·relu(q[t,h]·keys[j]) for j < n_visible[t] (default N), −inf beyond."""
    q, weights, keys = contiguous(q), contiguous(weights), contiguous(keys)
    if n_visible is None:
        n_visible = [keys.shape[0]] * q.shape[0]
    scores = empty_like(q, (q.shape[0], keys.shape[0]), np.float32)
    _dsv4.index_scores(capsule(q), capsule(weights), capsule(keys), capsule(as_index(n_visible, q, np.int64)),
                       bool(bf16), capsule(scores))
    return scores


def topk(scores, k, n_visible=None):
    """Top-k picks (SPEC §4.6): scores [T, N] → [T, k] int32, the k best of the first n_visible[t]
    entries that are not −inf, ascending, padded with −1 (NaN ranks lowest; ties: lower index)."""
    scores = contiguous(scores)
    if n_visible is None:
        n_visible = [scores.shape[1]] * scores.shape[0]
    picks = empty_like(scores, (scores.shape[0], k), np.int32)
    _dsv4.topk(capsule(scores), capsule(as_index(n_visible, scores, np.int64)), capsule(picks))
    return picks


def compressor_pool(kv, score, bias=None):
    """The compressor's gated pooling (SPEC §3): kv, score [E, S, D], bias [S, D] or None →
    pooled [E, D] = Σ_s softmax_s(score + bias) · kv per channel."""
    kv, score, bias = contiguous(kv), contiguous(score), contiguous(bias)
    pooled = empty_like(kv, (kv.shape[0], kv.shape[2]), np.float32)
    _dsv4.compressor_pool(capsule(kv), capsule(score), capsule(bias), capsule(pooled))
    return pooled
