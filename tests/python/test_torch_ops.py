"""torch.ops.dsv4: schemas, CPU kernels equal to dsv4.ops, shape-only kernels, CUDA kernels equal to
the CPU ones (on torch's current stream, capturable in a CUDA graph), and on torch >= 2.4
torch.library.opcheck and torch.compile on both devices."""
import numpy as np
import pytest

from conftest import cuda_or_skip, torch_or_skip

torch = torch_or_skip()
import dsv4  # noqa: E402,F401  (registers torch.ops.dsv4)
from dsv4 import ops  # noqa: E402

NEW_TORCH = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4)


def samples(device="cpu"):
    g = torch.Generator().manual_seed(0)
    # bf16-exact values: the CUDA kernels read q, kv and keys as bf16, so both devices see the same
    # inputs. Head dim 512, the CUDA attention's.
    q = torch.randn(3, 4, 512, generator=g).to(torch.bfloat16).float()
    kv = torch.randn(10, 512, generator=g).to(torch.bfloat16).float()
    indices = torch.tensor([[0, 3, 9, -1], [-1, -1, -1, -1], [2, 2, 5, 7]], dtype=torch.int32)
    sink = torch.randn(4, generator=g)
    w = torch.randn(3, 4, generator=g)
    n_visible = torch.tensor([10, 5, 1])
    pool_kv, pool_score, bias = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g), torch.randn(4, 8, generator=g)
    x = torch.randn(3, 512, generator=g)
    slots = torch.tensor([0, 7, -1])
    stride = ops.kv_page_geometry("v41_fp8", 512, 4)["page_stride"]
    pages = torch.zeros(2, stride, dtype=torch.uint8)
    cases = {
        "sparse_attention": (q, kv, indices, torch.tensor([4, 0, 2], dtype=torch.int32), sink, 0.125, False),
        "index_scores": (q, w, kv, n_visible, False),
        "topk": (torch.randn(3, 10, generator=g), n_visible, 4),
        "compressor_pool": (pool_kv, pool_score, bias),
        "kv_encode": ("v41_fp8", x, slots, pages, 4, "segregated", 1.0, "amax"),
        "kv_decode": ("v41_fp8", pages, slots, 512, 4, "segregated", 1.0),
    }
    move = lambda a: a.to(device) if isinstance(a, torch.Tensor) else a
    return {k: tuple(move(a) for a in v) for k, v in cases.items()}


def test_registered_with_schemas():
    for name in ("sparse_attention", "index_scores", "topk", "compressor_pool", "kv_encode", "kv_decode"):
        op = getattr(torch.ops.dsv4, name)
        assert name in str(op.default._schema)
    assert "Tensor(a!) pages" in str(torch.ops.dsv4.kv_encode.default._schema)


def test_cpu_kernels_match_ops():
    s = samples()
    out, lse = torch.ops.dsv4.sparse_attention(*s["sparse_attention"])
    q, kv, indices, lengths, sink, scale, _ = s["sparse_attention"]
    want, want_lse = ops.sparse_attention(q.numpy(), kv.numpy(), indices.numpy(), sink.numpy(), scale,
                                          lengths.numpy(), return_lse=True)
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    scores = torch.ops.dsv4.index_scores(*s["index_scores"])
    assert scores.shape == (3, 10) and torch.isinf(scores[2, 1:]).all()
    picks = torch.ops.dsv4.topk(*s["topk"])
    assert picks.dtype == torch.int32 and picks.shape == (3, 4) and (picks[2, 1:] == -1).all()
    pooled = torch.ops.dsv4.compressor_pool(*s["compressor_pool"])
    assert pooled.shape == (2, 8)
    torch.ops.dsv4.kv_encode(*s["kv_encode"])
    rows = torch.ops.dsv4.kv_decode(*s["kv_decode"])
    x = s["kv_encode"][1]
    assert ((rows[:2] - x[:2]).abs().max(dim=1).values <= 0.07 * x[:2].abs().max(dim=1).values).all()
    assert (rows[2] == 0).all()


def test_meta_shapes():
    s = samples("meta")
    out, lse = torch.ops.dsv4.sparse_attention(*s["sparse_attention"])
    assert out.device.type == "meta" and out.shape == (3, 4, 512) and lse.shape == (3, 4)
    assert torch.ops.dsv4.index_scores(*s["index_scores"]).shape == (3, 10)
    assert torch.ops.dsv4.topk(*s["topk"]).dtype == torch.int32
    assert torch.ops.dsv4.kv_decode(*s["kv_decode"]).shape == (3, 512)


OPS = ["sparse_attention", "index_scores", "topk", "compressor_pool", "kv_encode", "kv_decode"]


@pytest.mark.skipif(not NEW_TORCH, reason="torch.library.opcheck needs torch >= 2.4")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, device):
    if device == "cuda":
        cuda_or_skip()
    torch.library.opcheck(getattr(torch.ops.dsv4, name).default, samples(device)[name])


@pytest.mark.skipif(not NEW_TORCH, reason="torch.compile with custom ops needs torch >= 2.4")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compile(device):
    if device == "cuda":
        cuda_or_skip()
    s = samples(device)["sparse_attention"]

    def f(q, kv, indices, lengths, sink):
        out, lse = torch.ops.dsv4.sparse_attention(q, kv, indices, lengths, sink, 0.125, device == "cuda")
        return out * 2, lse

    got = torch.compile(f, fullgraph=True)(*s[:5])
    want = f(*s[:5])
    torch.testing.assert_close(got[0], want[0])


def run_op(name, args):
    """The op's outputs (kv_encode: the pages it wrote) as CPU tensors."""
    if name == "kv_encode":
        args = args[:3] + (args[3].clone(),) + args[4:]
        getattr(torch.ops.dsv4, name)(*args)
        return (args[3].cpu(),)
    out = getattr(torch.ops.dsv4, name)(*args)
    return tuple(o.cpu() for o in (out if isinstance(out, tuple) else (out,)))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("bf16", [False, True])
def test_cuda_kernels_match_cpu(name, bf16):
    """Each op's CUDA kernel against its CPU kernel on the same random inputs (fp32 arithmetic in
    another order: 1e-5 relative; top-k picks, encoded bytes and decoded rows exactly)."""
    cuda_or_skip()
    cpu, gpu = samples(), samples("cuda")
    if name in ("sparse_attention", "index_scores"):
        cpu[name] = cpu[name][:-1] + (bf16,)
        gpu[name] = gpu[name][:-1] + (bf16,)
    elif bf16:
        pytest.skip("no bf16 flag")
    if name == "kv_decode":  # decode what kv_encode wrote
        torch.ops.dsv4.kv_encode(*cpu["kv_encode"])
        gpu[name] = gpu[name][:1] + (cpu["kv_encode"][3].cuda(),) + gpu[name][2:]
    for want, got in zip(run_op(name, cpu[name]), run_op(name, gpu[name])):
        if want.dtype.is_floating_point:
            # bf16 rounding of exp-scores relative to a running max: one bf16 ulp of some weights.
            tol = 4e-3 if bf16 and name == "sparse_attention" else 1e-5
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        else:
            assert torch.equal(got, want)


def test_cuda_ops_on_current_stream_in_a_graph():
    """Attention, index scores and top-k queued on a side stream and captured in a CUDA graph (a
    synchronization or an allocation of dsv4's own would fail the capture); replays equal eager runs,
    also after the inputs change in place."""
    cuda_or_skip()
    s = samples("cuda")
    q, kv, indices, lengths, sink, scale, _ = s["sparse_attention"]
    w, n_visible = s["index_scores"][1], s["index_scores"][3]

    def step():
        out, lse = torch.ops.dsv4.sparse_attention(q, kv, indices, lengths, sink, scale, True)
        scores = torch.ops.dsv4.index_scores(q, w, kv, n_visible, True)
        return out, lse, scores, torch.ops.dsv4.topk(scores, n_visible, 4)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    for trial in range(2):
        graph.replay()
        for got, want in zip(captured, step()):
            assert torch.equal(got, want)
        q.copy_(torch.randn_like(q).to(torch.bfloat16).float())
