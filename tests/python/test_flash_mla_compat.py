"""dsv4.compat.flash_mla against a pure-torch reference of FlashMLA's documented semantics: pages
decoded here from the byte layouts of SPEC §7 (independently of dsv4's codecs), flat slot indices,
-1 invalid, topk_length prefixes, the sink scaling out by exp(lse) / (exp(lse) + exp(sink)),
lse [b, h_q, s_q] without the sink."""
import math

import pytest

from conftest import cuda_or_skip, torch_or_skip

torch = torch_or_skip()
from dsv4 import ops  # noqa: E402
from dsv4.compat import flash_mla  # noqa: E402

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)


def e4m3(b):
    b = b.long()
    sign = torch.where(b & 0x80 != 0, -1.0, 1.0).double()
    exp, man = (b >> 3) & 0xF, (b & 7).double()
    value = torch.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * torch.pow(2.0, (exp - 7).double()))
    return sign * value


def ue8m0(b):
    return torch.pow(2.0, b.double() - 127)


def e2m1_pairs(b):
    b = b.long()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    return torch.where(codes & 8 != 0, -1.0, 1.0).double() * E2M1[codes & 7]


def bf16_bytes(b):
    words = (b[..., 0::2].long() | (b[..., 1::2].long() << 8)) << 16
    return words.to(torch.int32).view(torch.float32).double()


def decode_row(fmt, placement, page, row, bs):
    """One token's 512 values from a page's bytes, as SPEC §7 lays them out."""
    if fmt == "fp8_ds_mla":  # segregated only: 576-byte data rows, then 8-byte scale rows
        data, scales = page[row * 576: row * 576 + 576], page[bs * 576 + row * 8: bs * 576 + row * 8 + 7]
        nope = e4m3(data[:448]) * ue8m0(scales).repeat_interleave(64)
        return torch.cat([nope, bf16_bytes(data[448:576])])
    data_bytes, scale_bytes = (512, 16) if fmt == "v41_fp8" else (256, 32)
    if placement == "interleaved":
        start = row * (data_bytes + scale_bytes)
        data, scales = page[start: start + data_bytes], page[start + data_bytes: start + data_bytes + scale_bytes]
    else:
        data = page[row * data_bytes: (row + 1) * data_bytes]
        scales = page[bs * data_bytes + row * scale_bytes: bs * data_bytes + (row + 1) * scale_bytes]
    if fmt == "v41_fp8":
        return e4m3(data) * ue8m0(scales).repeat_interleave(32)
    return e2m1_pairs(data) * e4m3(scales).repeat_interleave(16)


def reference(q, caches, sink, scale):
    """caches: [(k_cache pages [blocks, stride] u8, fmt, placement, bs, indices [b, s_q, k], lengths [b])]."""
    b, s_q, h_q, d = q.shape
    out = torch.zeros(b, s_q, h_q, d, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i in range(b):
        for s in range(s_q):
            rows = []
            for pages, fmt, placement, bs, indices, lengths in caches:
                count = indices.shape[-1] if lengths is None else int(lengths[i])
                for slot in indices[i, s, :count].tolist():
                    if slot != -1:
                        rows.append(decode_row(fmt, placement, pages[slot // bs], slot % bs, bs))
            if not rows:
                continue
            k = torch.stack(rows)
            logits = scale * q[i, s].double() @ k.T  # [h_q, n]
            l = torch.logsumexp(logits, dim=-1)
            p = torch.exp(logits - l[:, None])
            o = p @ k
            if sink is not None:
                o = o * (torch.exp(l) / (torch.exp(l) + torch.exp(sink.double())))[:, None]
            out[i, s], lse[i, :, s] = o, l
    return out, lse


def make_cache(fmt, placement, num_blocks, bs, gen):
    g = ops.kv_page_geometry(fmt, 512, bs, placement)
    pages = torch.zeros(num_blocks, g["page_stride"], dtype=torch.uint8)
    x = torch.randn(num_blocks * bs, 512, generator=gen)
    ops.kv_encode(fmt, x, torch.arange(num_blocks * bs), pages, bs, placement)
    # The [num_blocks, page_block_size, 1, bytes] view FlashMLA takes; blocks page_stride apart.
    view = torch.as_strided(pages, (num_blocks, bs, 1, g["row_bytes"]), (g["page_stride"], g["row_bytes"],
                                                                         g["row_bytes"], 1))
    return pages, view


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def test_decode_fp8_ds_mla_segregated(gen):
    flash_mla.set_page_placement("segregated")
    b, s_q, h_q, bs = 2, 2, 4, 64
    pages, k_cache = make_cache("fp8_ds_mla", "segregated", 3, bs, gen)
    q = torch.randn(b, s_q, h_q, 512, generator=gen).to(torch.bfloat16)
    indices = torch.randint(0, 3 * bs, (b, s_q, 16), generator=gen, dtype=torch.int32)
    indices[0, 1, 5:] = -1
    indices[1, 0, :] = -1
    lengths = torch.tensor([16, 9], dtype=torch.int32)
    sink = torch.randn(h_q, generator=gen)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, None, None, False, True,
                                               indices=indices, attn_sink=sink, topk_length=lengths)
    want, want_lse = reference(q.float(), [(pages, "fp8_ds_mla", "segregated", bs, indices, lengths)], sink,
                               512 ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert (out[1, 0] == 0).all() and torch.isposinf(lse[1, :, 0]).all()
    # The scheduler metadata is bound to the first call's shapes, as FlashMLA's is.
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(q[:1], k_cache, None, None, 512, meta, indices=indices[:1],
                                         is_fp8_kvcache=True)


def test_decode_v41_interleaved_with_extra_cache(gen):
    flash_mla.set_page_placement("interleaved")
    try:
        b, h_q, bs = 2, 8, 64
        swa_pages, swa = make_cache("v41_fp8", "interleaved", 2, bs, gen)
        cmp_pages, cmp = make_cache("v41_fp4", "interleaved", 2, bs, gen)
        q = torch.randn(b, 1, h_q, 512, generator=gen).to(torch.bfloat16)
        indices = torch.randint(0, 2 * bs, (b, 1, 8), generator=gen, dtype=torch.int32)
        extra = torch.randint(0, 2 * bs, (b, 1, 32), generator=gen, dtype=torch.int32)
        extra[1, 0, 20:] = -1
        lengths, extra_lengths = torch.tensor([8, 3], dtype=torch.int32), torch.tensor([32, 25], dtype=torch.int32)
        out, lse = flash_mla.flash_mla_with_kvcache(
            q, swa, None, None, 512, flash_mla.get_mla_metadata()[0], softmax_scale=0.05, is_fp8_kvcache=True,
            indices=indices, extra_k_cache=cmp, extra_indices_in_kvcache=extra, topk_length=lengths,
            extra_topk_length=extra_lengths)
        want, want_lse = reference(q.float(), [(swa_pages, "v41_fp8", "interleaved", bs, indices, lengths),
                                               (cmp_pages, "v41_fp4", "interleaved", bs, extra, extra_lengths)],
                                   None, 0.05)
        torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    finally:
        flash_mla.set_page_placement("segregated")


def test_decode_rejects_wrong_page_stride(gen):
    _, k_cache = make_cache("v41_fp8", "segregated", 1, 64, gen)
    bad = torch.zeros(1, 64, 1, 584, dtype=torch.uint8)  # fp8_ds_mla rows without the page padding
    q = torch.zeros(1, 1, 4, 512, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="37440"):
        flash_mla.flash_mla_with_kvcache(q, bad, None, None, 512, None, indices=idx, is_fp8_kvcache=True)


def test_sparse_prefill(gen):
    s_q, s_kv, h_q, topk = 5, 40, 4, 12
    q = torch.randn(s_q, h_q, 512, generator=gen).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, 512, generator=gen).to(torch.bfloat16)
    indices = torch.randint(0, s_kv, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    indices[0, 0, 3] = s_kv + 7   # >= s_kv: invalid
    indices[1, 0, :] = -1
    lengths = torch.tensor([12, 12, 5, 1, 12], dtype=torch.int32)
    sink = torch.randn(h_q, generator=gen)
    out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(q, kv, indices, 0.04, 512, sink, lengths)
    rows = kv[:, 0].double()
    for t in range(s_q):
        valid = [i for i in indices[t, 0, :int(lengths[t])].tolist() if 0 <= i < s_kv]
        if not valid:
            assert (out[t] == 0).all() and torch.isposinf(lse[t]).all() and torch.isneginf(max_logits[t]).all()
            continue
        logits = 0.04 * q[t].double() @ rows[valid].T
        l = torch.logsumexp(logits, dim=-1)
        o = torch.softmax(logits, dim=-1) @ rows[valid] * (torch.exp(l) / (torch.exp(l) + torch.exp(sink.double())))[:, None]
        torch.testing.assert_close(out[t].double(), o, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse[t].double(), l, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(max_logits[t].double(), logits.max(dim=-1).values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt,placement", [("fp8_ds_mla", "segregated"), ("v41_fp8", "interleaved"),
                                            ("v41_fp4", "segregated")])
def test_cuda_decode_against_reference(gen, fmt, placement):
    """On CUDA tensors: the pages are read in place on the device, the extra cache merged through
    the log-sum-exps, the sink applied once; the same numbers as the reference, in a CUDA graph too."""
    cuda_or_skip()
    flash_mla.set_page_placement(placement)
    try:
        b, h_q, bs = 3, 64, 64
        extra_fmt = "fp8_ds_mla" if fmt == "fp8_ds_mla" else "v41_fp4"  # V4.0 rows, or V4.1's compressed rows
        main_pages, main = make_cache(fmt, placement, 3, bs, gen)
        extra_pages, extra = make_cache(extra_fmt, placement, 2, bs, gen)
        q = torch.randn(b, 1, h_q, 512, generator=gen).to(torch.bfloat16)
        indices = torch.randint(-1, 3 * bs, (b, 1, 40), generator=gen, dtype=torch.int32)
        extra_idx = torch.randint(-1, 2 * bs, (b, 1, 96), generator=gen, dtype=torch.int32)
        lengths, extra_lengths = torch.tensor([40, 7, 0], dtype=torch.int32), torch.tensor([96, 50, 0], dtype=torch.int32)
        sink = torch.randn(h_q, generator=gen)
        want, want_lse = reference(q.float(), [(main_pages, fmt, placement, bs, indices, lengths),
                                               (extra_pages, extra_fmt, placement, bs, extra_idx, extra_lengths)],
                                   sink, 512 ** -0.5)
        dev = torch.device("cuda")
        on_gpu = lambda pages, view: torch.as_strided(pages.to(dev), view.shape, view.stride())
        args = dict(indices=indices.to(dev), attn_sink=sink.to(dev), extra_k_cache=on_gpu(extra_pages, extra),
                    extra_indices_in_kvcache=extra_idx.to(dev), topk_length=lengths.to(dev),
                    extra_topk_length=extra_lengths.to(dev), is_fp8_kvcache=True)
        gpu_cache = on_gpu(main_pages, main)
        q_gpu = q.to(dev)
        call = lambda: flash_mla.flash_mla_with_kvcache(q_gpu, gpu_cache, None, None, 512,
                                                        flash_mla.get_mla_metadata()[0], **args)
        out, lse = call()
        assert out.device.type == "cuda" and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=1e-5, atol=1e-5)
        assert torch.isposinf(lse[2]).all() and (out[2] == 0).all()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                captured = call()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], out) and torch.equal(captured[1], lse)
    finally:
        flash_mla.set_page_placement("segregated")


def test_cuda_sparse_prefill(gen):
    cuda_or_skip()
    s_q, s_kv, h_q, topk = 70, 300, 64, 96
    q = torch.randn(s_q, h_q, 512, generator=gen).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, 512, generator=gen).to(torch.bfloat16)
    indices = torch.randint(-1, s_kv + 20, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    sink = torch.randn(h_q, generator=gen)
    want = flash_mla.flash_mla_sparse_fwd(q, kv, indices, 0.04, attn_sink=sink)
    dev = torch.device("cuda")
    got = flash_mla.flash_mla_sparse_fwd(q.to(dev), kv.to(dev), indices.to(dev), 0.04, attn_sink=sink.to(dev))
    torch.testing.assert_close(got[0].cpu().double(), want[0].double(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-4, atol=1e-4)


def test_swap_example_runs():
    import pathlib
    import runpy
    example = pathlib.Path(__file__).resolve().parents[2] / "python" / "examples" / "flash_mla_swap.py"
    runpy.run_path(str(example), run_name="__main__")
