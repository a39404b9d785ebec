"""dsv4.Config, dsv4.Weights, dsv4.plan and dsv4.Engine on the CPU with numpy arrays."""
import numpy as np
import pytest

import dsv4


def test_config_and_plan(tiny):
    config, _ = tiny
    assert "tiny-v4.1" in dsv4.preset_names()
    assert config.family == "v4.1" and config.head_dim == 512 and config.total_layers == len(config.layers)
    sources = [p for p in config.layers if p.owns_indexer]
    assert sources and all(p.kind == "compressed" for p in sources)
    plan = dsv4.plan("tiny-v4.1", context=1024)
    assert plan.kv_bytes["v4.1-native"] < plan.kv_bytes["bf16"]
    assert plan.sequences_that_fit(1 << 30) == (1 << 30) // plan.kv_bytes["v4.1-native"]
    assert "compressor" in str(plan)
    with pytest.raises(AttributeError):
        config.no_such_field
    # tiny-v4.1 has neither image spans, DSpark draft layers nor the V4.0 QAT; v4.1-flash has the first two.
    assert (config.vision_max_n_token, config.num_dspark_targets, config.indexer_qat) == (0, 0, 0)
    flash = dsv4.Config.preset("v4.1-flash")
    assert flash.vision_max_n_token == 1024 and flash.num_dspark_targets == 3 and flash.dspark_block_size == 5


def test_config_errors(tmp_path):
    with pytest.raises(dsv4.InvalidArgumentError, match="no-such-preset"):
        dsv4.Config.preset("no-such-preset")
    with pytest.raises(dsv4.LoadError) as e:
        dsv4.Config.from_file(tmp_path / "missing.json")
    assert isinstance(e.value, OSError) and "missing.json" in str(e.value)
    with pytest.raises(dsv4.LoadError):
        dsv4.Config.from_json("{not json")


def test_weights_round_trip(tiny, tmp_path, rng):
    config, weights = tiny
    path = tmp_path / "w.safetensors"
    weights.save(path)
    loaded = dsv4.Weights.load(config, path)
    x = rng.standard_normal((7, config.hidden_size)).astype(np.float32)
    outs = []
    for w in (weights, loaded):
        engine = dsv4.Engine(config, w, max_sequences=2, max_context=256, max_tokens_per_step=64, num_threads=1)
        outs.append(engine.step([(engine.add_sequence(), 7)], x))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(dsv4.LoadError, match="does not exist"):
        dsv4.Weights.load(config, tmp_path / "none.safetensors")


def make_engine(tiny, **kw):
    config, weights = tiny
    options = dict(max_sequences=3, max_context=256, max_tokens_per_step=64, num_threads=1)
    options.update(kw)
    return dsv4.Engine(config, weights, **options)


def test_engine_steps_fork_release(tiny, rng):
    engine = make_engine(tiny)
    hidden = engine.config.hidden_size
    a = engine.add_sequence()
    prompt = rng.standard_normal((9, hidden)).astype(np.float32)
    engine.step({a: 9}, prompt)
    assert engine.sequence_length(a) == 9 and engine.sequence_cache_bytes(a) > 0
    b = engine.fork_sequence(a)
    # A decode token of the fork and of its parent see the same state: same output.
    token = rng.standard_normal((2, hidden)).astype(np.float32)
    token[1] = token[0]
    outs = engine.step([(a, 1), (b, 1)], token)
    for out in outs:
        np.testing.assert_array_equal(out[0], out[1])
    engine.release_sequence(b)
    with pytest.raises(dsv4.InvalidArgumentError, match="does not exist"):
        engine.sequence_length(b)
    m = engine.memory()
    assert m["total"] == m["weights"] + m["caches"] + m["workspace"] and m["weights"] > 0
    assert engine.cuda_stream == 0


def test_speculative_verify_and_rollback(tiny, rng):
    """A verify step (bonus token + 4 drafts), 2 drafts accepted: the sequence equals one that ran the
    3 accepted tokens one by one, then and in its next step."""
    engine = make_engine(tiny, max_rollback=4)
    hidden = engine.config.hidden_size
    spec, twin = engine.add_sequence(), engine.add_sequence()
    prompt = rng.standard_normal((20, hidden)).astype(np.float32)
    engine.step([(spec, 20), (twin, 20)], np.concatenate([prompt, prompt]))
    tokens = rng.standard_normal((5, hidden)).astype(np.float32)
    verify = engine.step({spec: 5}, tokens)
    engine.accept(spec, 20, 2)
    assert engine.sequence_length(spec) == 23
    one_by_one = [engine.step({twin: 1}, tokens[i:i + 1]) for i in range(3)]
    for layer, out in enumerate(verify):
        np.testing.assert_array_equal(out[:3], np.concatenate([o[layer] for o in one_by_one]))
    after = rng.standard_normal((1, hidden)).astype(np.float32)
    for a, b in zip(engine.step({spec: 1}, after), engine.step({twin: 1}, after)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(dsv4.InvalidArgumentError, match=r"expected a length in \[21, 24\]"):
        engine.rollback_sequence(spec, 19)


def test_engine_layer_by_layer_and_picks(tiny, rng):
    engine = make_engine(tiny)
    config = engine.config
    a = engine.add_sequence()
    x = rng.standard_normal((6, config.hidden_size)).astype(np.float32)
    engine.begin_step([(a, 6)])
    source = next(p.layer for p in config.layers if p.owns_indexer)
    assert engine.layer_picks(source).shape == (0, 0)
    for p in config.layers:
        if p.is_mtp:
            continue
        out = engine.run_layer(p.layer, x)
        assert out.shape == x.shape and np.isfinite(out).all()
    picks = engine.layer_picks(source)
    assert picks.shape == (6, config.index_topk) and picks.dtype == np.int32
    assert (picks[0, 1:] == -1).all()  # the first token sees at most one compressed entry
    engine.end_step()


def test_engine_errors(tiny, rng):
    engine = make_engine(tiny, max_sequences=1)
    hidden = engine.config.hidden_size
    a = engine.add_sequence()
    with pytest.raises(dsv4.PoolExhaustedError, match="sequences are live"):
        engine.add_sequence()
    with pytest.raises(dsv4.PoolExhaustedError):
        engine.fork_sequence(a)
    with pytest.raises(dsv4.InvalidArgumentError, match="no step is open"):
        engine.run_layer(0, np.zeros((1, hidden), np.float32))
    engine.begin_step([(a, 2)])
    with pytest.raises(dsv4.ShapeError, match=r"hidden_in has shape \[3, "):
        engine.run_layer(0, np.zeros((3, hidden), np.float32))
    with pytest.raises(dsv4.DTypeError, match="float64, expected float32"):
        engine.run_layer(0, np.zeros((2, hidden), np.float64))
    with pytest.raises(dsv4.LayoutError):
        engine.run_layer(0, np.zeros((hidden, 2), np.float32).T)
    with pytest.raises(dsv4.InvalidArgumentError, match="has not run"):
        engine.end_step()
    with pytest.raises(dsv4.InvalidArgumentError):
        engine.begin_step([(a, 1)])  # a step is in progress


def test_float_rows_and_fp32(tiny, rng):
    x = rng.standard_normal((4, tiny[0].hidden_size)).astype(np.float32)
    ref = make_engine(tiny, precision="fp32", cache_storage="float_rows")
    out = ref.step([(ref.add_sequence(), 4)], x)
    paged = make_engine(tiny, precision="fp32", kv_format="bf16")
    approx = paged.step([(paged.add_sequence(), 4)], x)
    for a, b in zip(out, approx):
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(a)


def test_unsupported_backend(tiny):
    if dsv4.has_cuda:
        pytest.skip("built with CUDA")
    with pytest.raises(dsv4.UnsupportedError, match="without CUDA"):
        make_engine(tiny, backend="cuda")


def test_image_spans(tiny, rng):
    # tiny-v4.1 takes no image spans (vision_max_n_token 0): the span reaches the engine's check.
    engine = make_engine(tiny)
    a = engine.add_sequence()
    with pytest.raises(dsv4.InvalidArgumentError, match=r"image span \[2, 5\] is given, but the model takes no"):
        engine.begin_step([(a, 8)], image_spans={a: [(2, 5)]})
    with pytest.raises(ValueError, match="not in the step"):
        engine.begin_step([(a, 8)], image_spans={a + 1: [(2, 5)]})
    # A V4.1 ModelArgs config takes spans of up to 1024 tokens (its default): only span tokens change
    # (here all of them: the span is longer than the window of 4).
    config = dsv4.Config.from_json(
        '{"dim": 256, "n_layers": 2, "n_heads": 4, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64,'
        ' "window_size": 4, "compress_ratios": [0, 1], "kv_source_layers": [1], "index_source_layers": [1],'
        ' "index_topk": 8, "dtype": "bf16"}')
    weights = dsv4.Weights.random(config, seed=3)
    x = rng.standard_normal((12, config.hidden_size)).astype(np.float32)
    outs = []
    for spans in (None, {0: [(3, 8)]}):
        e = dsv4.Engine(config, weights, max_sequences=1, max_context=64, max_tokens_per_step=16, num_threads=1)
        s = e.add_sequence()
        e.begin_step([(s, 12)], image_spans=spans and {s: spans[0]})
        outs.append([e.run_layer(layer, x) for layer in range(2)])
        e.end_step()
    for plain, spanned in zip(*outs):
        np.testing.assert_array_equal(plain[:3], spanned[:3])
        np.testing.assert_array_equal(plain[9:], spanned[9:])
        assert all(not np.array_equal(plain[p], spanned[p]) for p in range(3, 9))
