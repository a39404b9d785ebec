"""dsv4.ops on numpy arrays and torch CPU tensors against numpy formulas of SPEC §3-§7."""
import numpy as np
import pytest

import dsv4
from dsv4 import ops

from conftest import torch_or_skip

# Round-trip error bounds per format, relative to each row's max |x| (fp4 is coarse).
TOLERANCE = {"bf16": 4e-3, "fp8_per_tensor": 0.07, "v41_fp8": 0.07, "fp8_ds_mla": 0.07, "index_fp8": 0.07,
             "v41_fp4": 0.35, "index_mxfp4": 0.35, "f32": 0.0}


@pytest.mark.parametrize("placement", ["segregated", "interleaved"])
@pytest.mark.parametrize("fmt", ops.FORMATS)
def test_kv_round_trip_numpy(fmt, placement, rng):
    dims = 128 if fmt.startswith("index") else 512
    g = ops.kv_page_geometry(fmt, dims, 4, placement)
    assert g["row_bytes"] == g["data_bytes"] + g["scale_bytes"] and g["page_stride"] >= 4 * g["row_bytes"]
    pages = ops.kv_alloc_pages(fmt, 3, dims, 4, placement)
    x = rng.standard_normal((5, dims)).astype(np.float32)
    slots = np.array([0, 11, -1, 5, 6])
    ops.kv_encode(fmt, x, slots, pages, 4, placement)
    y = ops.kv_decode(fmt, pages, slots, dims, 4, placement)
    assert (y[2] == 0).all()
    keep = slots >= 0
    err = np.abs(y[keep] - x[keep]).max(axis=1) / np.abs(x[keep]).max(axis=1)
    assert (err <= TOLERANCE[fmt]).all(), err


def test_kv_fp8_ds_mla_layout(rng):
    """SPEC §7.1: 576-byte value rows, then 8-byte scale rows, the page padded to a multiple of 576;
    bytes 448..575 of a row are its RoPE channels as bf16."""
    g = ops.kv_page_geometry("fp8_ds_mla", 512, 64)
    assert (g["row_bytes"], g["page_stride"]) == (584, 37440)
    pages = ops.kv_alloc_pages("fp8_ds_mla", 1, 512, 64)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    ops.kv_encode("fp8_ds_mla", x, [3], pages, 64)
    rope = pages[0, 3 * 576 + 448: 3 * 576 + 576].view(np.uint16).astype(np.uint32) << 16
    np.testing.assert_allclose(rope.view(np.float32), x[0, 448:], rtol=1e-2)
    assert pages[0, 64 * 576 + 3 * 8 + 7] == 0 and pages[0, 64 * 576 + 3 * 8: 64 * 576 + 3 * 8 + 7].all()


def test_kv_errors(rng):
    pages = ops.kv_alloc_pages("v41_fp8", 1, 512, 4)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    with pytest.raises(dsv4.InvalidArgumentError, match=r"slots\[1\] = 4, expected < 4"):
        ops.kv_encode("v41_fp8", x, [0, 4], pages, 4)
    with pytest.raises(dsv4.ShapeError, match="pages has shape"):
        ops.kv_encode("v41_fp8", x, [0, 1], pages[:, :-1].copy(), 4)
    with pytest.raises(dsv4.DTypeError, match="x has dtype float64"):
        ops.kv_encode("v41_fp8", x.astype(np.float64), [0, 1], pages, 4)
    with pytest.raises(dsv4.InvalidArgumentError, match="fp5"):
        ops.kv_page_geometry("fp5")


def reference_attention(q, kv, indices, sink, scale):
    T, H, D = q.shape
    out, lse = np.zeros((T, H, D)), np.full((T, H), -np.inf)
    for t in range(T):
        rows = kv[[i for i in indices[t] if i >= 0]].astype(np.float64)
        if not len(rows):
            continue
        logits = scale * q[t].astype(np.float64) @ rows.T  # [H, n]
        m = logits.max(axis=1, keepdims=True)
        e = np.exp(logits - m)
        denom = e.sum(axis=1) + (np.exp(sink.astype(np.float64) - m[:, 0]) if sink is not None else 0)
        out[t] = (e @ rows) / denom[:, None]
        lse[t] = m[:, 0] + np.log(e.sum(axis=1))
    return out, lse


def test_sparse_attention(rng):
    q = rng.standard_normal((3, 4, 64)).astype(np.float32)
    kv = rng.standard_normal((10, 64)).astype(np.float32)
    indices = np.array([[0, 3, 9, -1], [-1, -1, -1, -1], [2, 2, 5, 7]], dtype=np.int32)
    sink = rng.standard_normal(4).astype(np.float32)
    out, lse = ops.sparse_attention(q, kv, indices, sink, return_lse=True)
    want, want_lse = reference_attention(q, kv, indices, sink, 1 / 8)
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_allclose(lse[[0, 2]], want_lse[[0, 2]], atol=1e-5)
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    # topk_length cuts the list; no sink: plain softmax.
    short = ops.sparse_attention(q, kv, indices, None, 0.5, topk_length=[2, 0, 1])
    want_short, _ = reference_attention(q, kv, np.where(np.arange(4) < np.array([[2], [0], [1]]), indices, -1),
                                        None, 0.5)
    np.testing.assert_allclose(short, want_short, atol=1e-5)


def test_index_scores_and_topk(rng):
    q = rng.standard_normal((2, 3, 16)).astype(np.float32)
    w = rng.standard_normal((2, 3)).astype(np.float32)
    keys = rng.standard_normal((9, 16)).astype(np.float32)
    scores = ops.index_scores(q, w, keys, n_visible=[9, 4])
    want = np.einsum("th,thj->tj", w.astype(np.float64), np.maximum(np.einsum("thd,jd->thj", q, keys), 0))
    np.testing.assert_allclose(scores[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scores[1, :4], want[1, :4], rtol=1e-5, atol=1e-5)
    assert np.isneginf(scores[1, 4:]).all()
    picks = ops.topk(scores, 3, n_visible=[9, 2])
    assert picks.dtype == np.int32
    np.testing.assert_array_equal(picks[0], np.sort(np.argsort(-want[0], kind="stable")[:3]))
    np.testing.assert_array_equal(picks[1], [0, 1, -1])


def test_compressor_pool(rng):
    kv = rng.standard_normal((3, 4, 8)).astype(np.float32)
    score = rng.standard_normal((3, 4, 8)).astype(np.float32)
    bias = rng.standard_normal((4, 8)).astype(np.float32)
    pooled = ops.compressor_pool(kv, score, bias)
    s = score + bias
    p = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(pooled, (p / p.sum(axis=1, keepdims=True) * kv).sum(axis=1), rtol=1e-5, atol=1e-6)


def test_ops_on_torch_tensors(rng):
    torch = torch_or_skip()
    q = rng.standard_normal((2, 3, 32)).astype(np.float32)
    kv = rng.standard_normal((5, 32)).astype(np.float32)
    indices = np.array([[0, 4, -1], [1, 2, 3]], dtype=np.int32)
    want = ops.sparse_attention(q, kv, indices)
    got = ops.sparse_attention(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(indices))
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), want)
    # Non-contiguous inputs are made contiguous.
    got_t = ops.sparse_attention(torch.from_numpy(q).transpose(0, 1).contiguous().transpose(0, 1),
                                 torch.from_numpy(kv), torch.from_numpy(indices))
    np.testing.assert_array_equal(got_t.numpy(), want)
    pages = ops.kv_alloc_pages("v41_fp4", 1, like=torch.zeros(1))
    ops.kv_encode("v41_fp4", torch.from_numpy(kv.repeat(16, axis=1)), torch.tensor([0, 1, 2, 3, 4]), pages)
    assert isinstance(pages, torch.Tensor) and pages.any()
