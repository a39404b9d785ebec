"""The engine on the GPU with torch CUDA tensors: torch's current stream, no device-wide sync,
the same outputs as the CPU engine within the precision's tolerance, CUDA-graph capture of a
step's layers. Skipped without a CUDA device or a CUDA build of dsv4."""
import numpy as np
import pytest

import dsv4

from conftest import cuda_or_skip

OPTIONS = dict(max_sequences=4, max_context=1024, max_tokens_per_step=256)


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_cpu(config, weights, x, entries):
    engine = dsv4.Engine(config, weights, num_threads=0, **OPTIONS)
    seqs = [engine.add_sequence() for _ in entries]
    return engine.step(list(zip(seqs, entries)), x)


def test_engine_on_torch_stream(tiny, rng):
    torch = cuda_or_skip()
    config, weights = tiny
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        engine = dsv4.Engine(config, weights, backend="cuda", **OPTIONS)
        assert engine.cuda_stream == stream.cuda_stream
        x = rng.standard_normal((37 + 1, config.hidden_size)).astype(np.float32)
        xs = torch.from_numpy(x).cuda()
        a, b = engine.add_sequence(), engine.add_sequence()
        outs = engine.step([(a, 37), (b, 1)], xs)
        assert all(o.is_cuda for o in outs)
    stream.synchronize()
    want = run_cpu(config, weights, x, [37, 1])
    for got, ref in zip(outs, want):
        assert rel_l2(got.cpu().numpy(), ref) < 2e-2
    m = engine.memory()
    assert m["weights"] > 0 and m["workspace"] > 0


def test_engine_rejects_host_tensors(tiny):
    torch = cuda_or_skip()
    config, weights = tiny
    engine = dsv4.Engine(config, weights, backend="cuda", **OPTIONS)
    engine.begin_step([(engine.add_sequence(), 2)])
    with pytest.raises(dsv4.DeviceError, match="expected a CUDA device"):
        engine.run_layer(0, torch.zeros(2, config.hidden_size))


def test_step_layers_in_a_cuda_graph(tiny, rng):
    """begin_step does the host bookkeeping; the layers' GPU work of the step is captured into a
    graph on the engine's stream and replayed: the outputs equal an eager engine's."""
    torch = cuda_or_skip()
    config, weights = tiny
    x = torch.from_numpy(rng.standard_normal((8, config.hidden_size)).astype(np.float32)).cuda()
    eager = dsv4.Engine(config, weights, backend="cuda", **OPTIONS)
    want = eager.step([(eager.add_sequence(), 8)], x)
    torch.cuda.synchronize()

    stream = torch.cuda.Stream()
    engine = dsv4.Engine(config, weights, backend="cuda", stream=stream, **OPTIONS)
    s = engine.add_sequence()
    outs = [torch.empty_like(x) for p in config.layers if not p.is_mtp]
    engine.begin_step([(s, 8)])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for out, p in zip(outs, [p for p in config.layers if not p.is_mtp]):
            engine.run_layer(p.layer, x, out)
    graph.replay()
    engine.end_step()
    torch.cuda.synchronize()
    for got, ref in zip(outs, want):
        torch.testing.assert_close(got, ref)
