"""dsv4's operations as PyTorch operators: torch.ops.dsv4.<op>, with schemas, CPU kernels (the
reference, through the C API) and shape-only (Meta / fake) kernels for torch.compile and
FakeTensor. Registered when ``import dsv4`` finds torch; works eagerly on torch 1.13 and with
torch.library.opcheck on torch >= 2.4. There are no CUDA kernels yet: CUDA tensors raise
NotImplementedError from the dispatcher (run the engine for the GPU path).

    torch.ops.dsv4.sparse_attention(q, kv, indices, topk_length, sink, scale, bf16) -> (out, lse)
    torch.ops.dsv4.index_scores(q, weights, keys, n_visible, bf16) -> scores
    torch.ops.dsv4.topk(scores, n_visible, k) -> picks
    torch.ops.dsv4.compressor_pool(kv, score, bias) -> pooled
    torch.ops.dsv4.kv_encode(format, x, slots, pages!, rows_per_page, placement, tensor_scale, fp8_scale_floor) -> ()
    torch.ops.dsv4.kv_decode(format, pages, slots, dims, rows_per_page, placement, tensor_scale) -> rows
"""

import torch

from . import _dsv4
from ._tensors import capsule

SCHEMAS = {
    "sparse_attention": "sparse_attention(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? sink, "
                        "float scale, bool bf16) -> (Tensor, Tensor)",
    "index_scores": "index_scores(Tensor q, Tensor weights, Tensor keys, Tensor n_visible, bool bf16) -> Tensor",
    "topk": "topk(Tensor scores, Tensor n_visible, int k) -> Tensor",
    "compressor_pool": "compressor_pool(Tensor kv, Tensor score, Tensor? bias) -> Tensor",
    "kv_encode": "kv_encode(str format, Tensor x, Tensor slots, Tensor(a!) pages, int rows_per_page, str placement, "
                 "float tensor_scale, str fp8_scale_floor) -> ()",
    "kv_decode": "kv_decode(str format, Tensor pages, Tensor slots, int dims, int rows_per_page, str placement, "
                 "float tensor_scale) -> Tensor",
}


def _c(x):
    return None if x is None else capsule(x.contiguous())


# ---- CPU kernels: the C API's reference ------------------------------------------------------

def _sparse_attention_cpu(q, kv, indices, topk_length, sink, scale, bf16):
    out = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    _dsv4.sparse_attention(_c(q), _c(kv), _c(indices), _c(topk_length), _c(sink), scale, bf16, capsule(out),
                           capsule(lse))
    return out, lse


def _index_scores_cpu(q, weights, keys, n_visible, bf16):
    scores = torch.empty((q.shape[0], keys.shape[0]), dtype=torch.float32)
    _dsv4.index_scores(_c(q), _c(weights), _c(keys), _c(n_visible), bf16, capsule(scores))
    return scores


def _topk_cpu(scores, n_visible, k):
    picks = torch.empty((scores.shape[0], k), dtype=torch.int32)
    _dsv4.topk(_c(scores), _c(n_visible), capsule(picks))
    return picks


def _compressor_pool_cpu(kv, score, bias):
    pooled = torch.empty((kv.shape[0], kv.shape[2]), dtype=torch.float32)
    _dsv4.compressor_pool(_c(kv), _c(score), _c(bias), capsule(pooled))
    return pooled


def _kv_encode_cpu(format, x, slots, pages, rows_per_page, placement, tensor_scale, fp8_scale_floor):
    if not pages.is_contiguous():
        raise ValueError("dsv4: kv_encode: pages must be contiguous (they are written in place)")
    _dsv4.kv_encode(format, rows_per_page, placement, _c(x), _c(slots), capsule(pages), tensor_scale,
                    fp8_scale_floor)


def _kv_decode_cpu(format, pages, slots, dims, rows_per_page, placement, tensor_scale):
    out = torch.empty((slots.shape[0], dims), dtype=torch.float32)
    _dsv4.kv_decode(format, rows_per_page, placement, _c(pages), _c(slots), capsule(out), tensor_scale)
    return out


# ---- Shape-only kernels (Meta tensors, FakeTensor / torch.compile) ------------------------------

def _sparse_attention_fake(q, kv, indices, topk_length, sink, scale, bf16):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32)


def _index_scores_fake(q, weights, keys, n_visible, bf16):
    return q.new_empty((q.shape[0], keys.shape[0]), dtype=torch.float32)


def _topk_fake(scores, n_visible, k):
    return scores.new_empty((scores.shape[0], k), dtype=torch.int32)


def _compressor_pool_fake(kv, score, bias):
    return kv.new_empty((kv.shape[0], kv.shape[2]), dtype=torch.float32)


def _kv_encode_fake(format, x, slots, pages, rows_per_page, placement, tensor_scale, fp8_scale_floor):
    return None


def _kv_decode_fake(format, pages, slots, dims, rows_per_page, placement, tensor_scale):
    return pages.new_empty((slots.shape[0], dims), dtype=torch.float32)


_KERNELS = {
    "sparse_attention": (_sparse_attention_cpu, _sparse_attention_fake),
    "index_scores": (_index_scores_cpu, _index_scores_fake),
    "topk": (_topk_cpu, _topk_fake),
    "compressor_pool": (_compressor_pool_cpu, _compressor_pool_fake),
    "kv_encode": (_kv_encode_cpu, _kv_encode_fake),
    "kv_decode": (_kv_decode_cpu, _kv_decode_fake),
}

_libraries = []  # the torch.library.Library objects must outlive the registrations


def register():
    """Defines torch.ops.dsv4.* (once per process, whichever copy of the package comes first)."""
    if _libraries or hasattr(torch.ops, "dsv4") and _defined("sparse_attention"):
        return
    lib = torch.library.Library("dsv4", "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        cpu, fake = _KERNELS[name]
        lib.impl(name, cpu, "CPU")
        if hasattr(torch.library, "register_fake"):
            torch.library.register_fake(f"dsv4::{name}", fake, lib=lib)
        else:  # torch < 2.4: Meta kernels; 1.13 has no autograd fallthrough for Meta, so both keys
            lib.impl(name, fake, "Meta")
            lib.impl(name, fake, "AutogradMeta")
    _libraries.append(lib)


def _defined(name):
    try:
        getattr(torch.ops.dsv4, name)
        return True
    except (AttributeError, RuntimeError):
        return False


register()
