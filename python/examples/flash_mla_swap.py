"""The two-line swap: a vLLM-style sparse MLA decode (`forward_mqa` of a DeepSeek V4 attention
layer) that calls FlashMLA, running on dsv4 instead. Run: PYTHONPATH=build/python python3 this.py"""
import torch

# from flash_mla import flash_mla_with_kvcache, get_mla_metadata      # before
from dsv4.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata  # after
from dsv4 import ops


class SparseMlaDecode:
    """What a serving engine's V4 layer does at decode: one query token per request attends its
    sliding-window rows (k_cache) and its top-k compressed rows (extra_k_cache), with a sink."""

    def __init__(self, num_heads, attn_sink, scale):
        self.num_heads, self.attn_sink, self.scale = num_heads, attn_sink, scale

    def forward_mqa(self, q, swa_cache, swa_indices, swa_lens, compressed_cache, topk_slots, topk_lens):
        metadata, _ = get_mla_metadata()
        out, lse = flash_mla_with_kvcache(
            q.unsqueeze(1), swa_cache, None, None, 512, metadata, softmax_scale=self.scale, is_fp8_kvcache=True,
            indices=swa_indices.unsqueeze(1), attn_sink=self.attn_sink, extra_k_cache=compressed_cache,
            extra_indices_in_kvcache=topk_slots.unsqueeze(1), topk_length=swa_lens, extra_topk_length=topk_lens)
        return out.squeeze(1)


def fp8_ds_mla_cache(num_blocks, block_size, gen):
    """vLLM's fp8_ds_mla pages filled with random rows, viewed as FlashMLA takes them."""
    g = ops.kv_page_geometry("fp8_ds_mla", 512, block_size)
    pages = torch.zeros(num_blocks, g["page_stride"], dtype=torch.uint8)
    rows = torch.randn(num_blocks * block_size, 512, generator=gen)
    ops.kv_encode("fp8_ds_mla", rows, torch.arange(num_blocks * block_size), pages, block_size)
    return torch.as_strided(pages, (num_blocks, block_size, 1, 584), (g["page_stride"], 584, 584, 1))


def main():
    gen = torch.Generator().manual_seed(0)
    heads, batch, block = 8, 2, 64
    layer = SparseMlaDecode(heads, torch.zeros(heads), 512 ** -0.5)
    q = torch.randn(batch, heads, 512, generator=gen).to(torch.bfloat16)
    out = layer.forward_mqa(q, fp8_ds_mla_cache(4, block, gen),
                            torch.randint(0, 4 * block, (batch, 128), generator=gen, dtype=torch.int32),
                            torch.tensor([128, 40], dtype=torch.int32), fp8_ds_mla_cache(2, block, gen),
                            torch.randint(0, 2 * block, (batch, 64), generator=gen, dtype=torch.int32),
                            torch.tensor([64, 10], dtype=torch.int32))
    print("out", tuple(out.shape), out.dtype, "finite:", bool(torch.isfinite(out.float()).all()))


if __name__ == "__main__":
    main()
