"""dsv4's operations as PyTorch operators: torch.ops.dsv4.<op>, with schemas, CPU kernels (the
reference), CUDA kernels (dsv4's CUDA ops, on torch's current stream, without synchronizing, so
they can be captured in CUDA graphs) and shape-only (Meta / fake) kernels for torch.compile and
FakeTensor. Registered when ``import dsv4`` finds torch; works eagerly on torch 1.13 and with
torch.library.opcheck on torch >= 2.4.

    torch.ops.dsv4.sparse_attention(q, kv, indices, topk_length, sink, scale, bf16) -> (out, lse)
    torch.ops.dsv4.paged_sparse_attention(q, pages, format, rows_per_page, placement, tensor_scale, indices,
                                          topk_length, sink, scale, bf16) -> (out, lse)
    torch.ops.dsv4.index_scores(q, weights, keys, n_visible, bf16) -> scores
    torch.ops.dsv4.topk(scores, n_visible, k) -> picks
    torch.ops.dsv4.compressor_pool(kv, score, bias) -> pooled
    torch.ops.dsv4.kv_encode(format, x, slots, pages!, rows_per_page, placement, tensor_scale, fp8_scale_floor) -> ()
    torch.ops.dsv4.kv_decode(format, pages, slots, dims, rows_per_page, placement, tensor_scale) -> rows

On CUDA, attention and index scores read q, kv and keys as bfloat16 (the kernels' input dtype;
float32 inputs are rounded to it) and attention needs head dim 512; compressor_pool runs as torch
operations (softmax, product and sum in float32).
"""

import torch

from . import ops

SCHEMAS = {
    "sparse_attention": "sparse_attention(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? sink, "
                        "float scale, bool bf16) -> (Tensor, Tensor)",
    "paged_sparse_attention": "paged_sparse_attention(Tensor q, Tensor pages, str format, int rows_per_page, "
                              "str placement, float tensor_scale, Tensor indices, Tensor? topk_length, Tensor? sink, "
                              "float scale, bool bf16) -> (Tensor, Tensor)",
    "index_scores": "index_scores(Tensor q, Tensor weights, Tensor keys, Tensor n_visible, bool bf16) -> Tensor",
    "topk": "topk(Tensor scores, Tensor n_visible, int k) -> Tensor",
    "compressor_pool": "compressor_pool(Tensor kv, Tensor score, Tensor? bias) -> Tensor",
    "kv_encode": "kv_encode(str format, Tensor x, Tensor slots, Tensor(a!) pages, int rows_per_page, str placement, "
                 "float tensor_scale, str fp8_scale_floor) -> ()",
    "kv_decode": "kv_decode(str format, Tensor pages, Tensor slots, int dims, int rows_per_page, str placement, "
                 "float tensor_scale) -> Tensor",
}


# ---- Kernels: the C API, which runs where the tensors are (the reference on the CPU, the CUDA ops
# on the GPU, queued on torch's current stream) --------------------------------------------------

def _sparse_attention(q, kv, indices, topk_length, sink, scale, bf16):
    return ops.sparse_attention(q, kv, indices, sink=sink, scale=scale, topk_length=topk_length, bf16=bf16,
                                return_lse=True)


def _paged_sparse_attention(q, pages, format, rows_per_page, placement, tensor_scale, indices, topk_length, sink,
                            scale, bf16):
    return ops.paged_sparse_attention(q, pages, format, indices, rows_per_page=rows_per_page, placement=placement,
                                      sink=sink, scale=scale, topk_length=topk_length, bf16=bf16,
                                      tensor_scale=tensor_scale, return_lse=True)


def _index_scores(q, weights, keys, n_visible, bf16):
    return ops.index_scores(q, weights, keys, n_visible=n_visible, bf16=bf16)


def _topk(scores, n_visible, k):
    return ops.topk(scores, k, n_visible=n_visible)


def _compressor_pool_cpu(kv, score, bias):
    return ops.compressor_pool(kv, score, bias)


def _compressor_pool_cuda(kv, score, bias):
    logits = score.float() if bias is None else score.float() + bias.float()
    return (torch.softmax(logits, dim=1) * kv.float()).sum(dim=1)


def _kv_encode(format, x, slots, pages, rows_per_page, placement, tensor_scale, fp8_scale_floor):
    if not pages.is_contiguous():
        raise ValueError("dsv4: kv_encode: pages must be contiguous (they are written in place)")
    ops.kv_encode(format, x, slots, pages, rows_per_page=rows_per_page, placement=placement,
                  tensor_scale=tensor_scale, fp8_scale_floor=fp8_scale_floor)


def _kv_decode(format, pages, slots, dims, rows_per_page, placement, tensor_scale):
    return ops.kv_decode(format, pages, slots, dims=dims, rows_per_page=rows_per_page, placement=placement,
                         tensor_scale=tensor_scale)


# ---- Shape-only kernels (Meta tensors, FakeTensor / torch.compile) ------------------------------

def _sparse_attention_fake(q, kv, indices, topk_length, sink, scale, bf16):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32)


def _paged_sparse_attention_fake(q, pages, format, rows_per_page, placement, tensor_scale, indices, topk_length,
                                 sink, scale, bf16):
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


# name: (CPU kernel, CUDA kernel, fake kernel)
_KERNELS = {
    "sparse_attention": (_sparse_attention, _sparse_attention, _sparse_attention_fake),
    "paged_sparse_attention": (_paged_sparse_attention, _paged_sparse_attention, _paged_sparse_attention_fake),
    "index_scores": (_index_scores, _index_scores, _index_scores_fake),
    "topk": (_topk, _topk, _topk_fake),
    "compressor_pool": (_compressor_pool_cpu, _compressor_pool_cuda, _compressor_pool_fake),
    "kv_encode": (_kv_encode, _kv_encode, _kv_encode_fake),
    "kv_decode": (_kv_decode, _kv_decode, _kv_decode_fake),
}

_libraries = []  # the torch.library.Library objects must outlive the registrations


def register():
    """Defines torch.ops.dsv4.* (once per process, whichever copy of the package comes first)."""
    if _libraries or hasattr(torch.ops, "dsv4") and _defined("sparse_attention"):
        return
    lib = torch.library.Library("dsv4", "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        cpu, cuda, fake = _KERNELS[name]
        lib.impl(name, cpu, "CPU")
        lib.impl(name, cuda, "CUDA")
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
