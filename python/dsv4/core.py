"""Config, weights, the engine and the plan: the C++ engine API (include/dsv4/engine.h) as Python
objects over the C API."""

import dataclasses
import os

import numpy as np

from . import _dsv4
from ._tensors import capsule, empty_like

_INT_FIELDS = ("hidden_size", "num_layers", "num_mtp_layers", "total_layers", "num_heads", "head_dim",
               "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
               "index_head_dim", "index_topk", "candidate_source_layer", "candidate_topk_blocks",
               "candidate_block_size", "tensor_parallel_size", "vision_max_n_token", "dspark_block_size",
               "num_dspark_targets", "indexer_qat")


def preset_names():
    """The embedded presets: "v4.1-flash", "v4-flash", "v4-pro", "tiny-v4.1", "tiny-v4"."""
    return _dsv4.preset_names().split("\n")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer's resolved role (SPEC §1.3); kind is "sliding", "compressed", "csa" or "hca"."""
    layer: int
    kind: str
    compress_ratio: int
    is_mtp: bool
    uses_compress_rope: bool
    kv_source: int
    index_source: int
    owns_compressor: bool
    owns_index_keys: bool
    owns_indexer: bool
    is_candidate_source: bool
    uses_candidates: bool


class Config:
    """A model configuration: ``Config.preset(name)``, ``Config.from_file(path)`` (any config.json
    form of docs/config.md), ``Config.from_json(text)`` or ``Config.load(preset_or_path)``.
    Integer fields are attributes (``config.hidden_size``, ``config.index_topk``, ...)."""

    def __init__(self, handle):
        self._h = handle

    @classmethod
    def preset(cls, name):
        return cls(_dsv4.Config.from_preset(name))

    @classmethod
    def from_file(cls, path):
        return cls(_dsv4.Config.from_file(os.fspath(path)))

    @classmethod
    def from_json(cls, text):
        return cls(_dsv4.Config.from_json(text))

    @classmethod
    def load(cls, preset_or_path):
        """A preset name or a config file path, as the CLI's --preset / --config take them."""
        if str(preset_or_path) in preset_names():
            return cls.preset(str(preset_or_path))
        return cls.from_file(preset_or_path)

    @property
    def name(self):
        return self._h.name()

    @property
    def family(self):
        return "v4.1" if self._h.get_int("family") == 1 else "v4.0"

    def __getattr__(self, field):
        if field in _INT_FIELDS:
            return self._h.get_int(field)
        raise AttributeError(f"dsv4.Config has no field '{field}'")

    def layer_plan(self, layer):
        return LayerPlan(**self._h.layer_plan(layer))

    @property
    def layers(self):
        """Every layer's plan, MTP layers included."""
        return [self.layer_plan(l) for l in range(self.total_layers)]

    def kv_bytes(self, context, kv_format=None, precision="reference"):
        """KV bytes (pages included) one sequence of `context` tokens holds in all caches."""
        return self._h.kv_bytes(kv_format, precision, context)

    def __repr__(self):
        return (f"dsv4.Config({self.name!r}, {self.family}, {self.num_layers}+{self.num_mtp_layers} layers, "
                f"hidden {self.hidden_size}, {self.num_heads} heads)")


class Weights:
    """Attention weights: ``Weights.load(config, path)`` (a .safetensors file, a sharded index JSON
    or a directory; transformers or DeepSeek names, bf16 or fp8 with block scales) or
    ``Weights.random(config, seed, fp8)``."""

    def __init__(self, handle):
        self._h = handle

    @classmethod
    def load(cls, config, path):
        return cls(_dsv4.Weights.load(config._h, os.fspath(path)))

    @classmethod
    def random(cls, config, seed=0, fp8=False):
        return cls(_dsv4.Weights.random(config._h, seed, fp8))

    def save(self, path):
        """Writes native names (``layers.{l}.attn.*``), fp8 scales as ``*.scale``."""
        self._h.save(os.fspath(path))


def _current_torch_stream():
    import torch
    return torch.cuda.current_stream().cuda_stream


class Engine:
    """The attention stack of a model as a serving engine drives it (include/dsv4/engine.h).

    backend "cpu" or "cuda"; precision "reference" or "fp32"; cache_storage "paged" (byte formats,
    every backend) or "float_rows" (cpu); kv_format a format set ("v4.1-native", "fp8_ds_mla",
    "bf16", "fp8") or "" for the precision's defaults. With the cuda backend the engine queues all
    its work on `stream` (a cudaStream_t as an int, or a torch.cuda.Stream); None: torch's current
    stream when torch is imported with CUDA, else a stream of the engine's own. max_rollback: the
    most tokens rollback_sequence may take back (speculative decoding). attention_stage_bytes (cuda on
    Hopper): device memory in which a prefill step's attended cache pages are decoded to bf16 once
    per layer (the same outputs, faster prefill; 0: never).
    """

    def __init__(self, config, weights, backend="cpu", precision="reference", cache_storage="paged", kv_format="",
                 max_sequences=256, max_tokens_per_step=8192, max_context=1 << 16, num_threads=0, stream=None,
                 max_rollback=0, attention_stage_bytes=512 << 20):
        if backend == "cuda" and stream is None:
            try:
                stream = _current_torch_stream()
            except Exception:  # no torch or no CUDA: the engine makes its own stream
                stream = 0
        if stream is not None and hasattr(stream, "cuda_stream"):
            stream = stream.cuda_stream
        self._h = _dsv4.Engine(config._h, weights._h, backend, precision, cache_storage, kv_format, max_sequences,
                               max_tokens_per_step, max_context, num_threads, int(stream or 0), max_rollback,
                               attention_stage_bytes)
        self.config = Config(self._h.config())
        self.backend = backend
        self._step_tokens = None

    def add_sequence(self):
        """A new empty sequence; PoolExhaustedError when max_sequences are live."""
        return self._h.add_sequence()

    def fork_sequence(self, parent):
        """A new sequence that starts with parent's whole state (prefix sharing, copy on write)."""
        return self._h.fork_sequence(parent)

    def release_sequence(self, sequence):
        self._h.release_sequence(sequence)

    def rollback_sequence(self, sequence, new_length):
        """Takes back the sequence's tokens from new_length on: after a verify step of the bonus token
        and K drafts, rollback_sequence(s, length_before + 1 + accepted). Exact: the sequence then
        continues as if it had only ever run its first new_length tokens."""
        self._h.rollback_sequence(sequence, new_length)

    def accept(self, sequence, length_before, accepted):
        """After a verify step that started at length_before: keeps the bonus token and `accepted`
        drafts, rolls back the rest."""
        self.rollback_sequence(sequence, length_before + 1 + accepted)

    def sequence_length(self, sequence):
        return self._h.sequence_length(sequence)

    def sequence_cache_bytes(self, sequence):
        return self._h.sequence_cache_bytes(sequence)

    def begin_step(self, entries, image_spans=None):
        """Starts a step. entries: [(sequence, num_tokens), ...] or {sequence: num_tokens}; tokens are
        appended at each sequence's length, in this order. image_spans (optional): {sequence:
        [(first, last), ...]}, absolute inclusive positions inside the sequence's entry (SPEC §14).
        All cache space is reserved here: PoolExhaustedError leaves everything unchanged."""
        items = list(entries.items()) if isinstance(entries, dict) else [tuple(e) for e in entries]
        image_spans = image_spans or {}
        unknown = set(image_spans) - {int(s) for s, _ in items}
        if unknown:
            raise ValueError(f"dsv4: begin_step: image spans for sequence(s) {sorted(unknown)} not in the step")
        spans = [[(int(a), int(b)) for a, b in image_spans.get(int(s), ())] for s, _ in items]
        self._h.begin_step([int(s) for s, _ in items], [int(n) for _, n in items], [len(x) for x in spans],
                           [v for x in spans for span in x for v in span])
        self._step_tokens = sum(int(n) for _, n in items)

    def run_layer(self, layer, hidden_in, attn_out=None):
        """Runs `layer` of the step: hidden_in [step_tokens, hidden_size] float32 (numpy, or torch
        on the engine's device); returns attn_out (allocated like hidden_in when None; it may be
        hidden_in itself)."""
        if attn_out is None:
            attn_out = empty_like(hidden_in, (hidden_in.shape[0], hidden_in.shape[1]), np.float32)
        self._h.run_layer(layer, capsule(hidden_in), capsule(attn_out))
        return attn_out

    def layer_picks(self, layer):
        """The picks an index-source layer published in this step: [step_tokens, index_topk] int32
        numpy (compressed positions, sorted, -1 padded); empty before the layer ran."""
        rows, cols = self._h.layer_picks_shape(layer)
        out = np.empty((rows, cols), dtype=np.int32)
        self._h.layer_picks(layer, capsule(out))
        return out

    def end_step(self):
        """Commits the step: every backbone layer must have run."""
        self._h.end_step()
        self._step_tokens = None

    def step(self, entries, hidden_in):
        """One whole step: begin_step(entries), every backbone layer on hidden_in (one array for all
        layers, or a list with one per layer), end_step. Returns the outputs, one per backbone layer."""
        self.begin_step(entries)
        outs = []
        for plan in self.config.layers:
            if plan.is_mtp:
                continue
            x = hidden_in[plan.layer] if isinstance(hidden_in, (list, tuple)) else hidden_in
            outs.append(self.run_layer(plan.layer, x))
        self.end_step()
        return outs

    def memory(self):
        """Bytes the engine holds on its device: {"weights", "caches", "workspace", "total"}."""
        m = self._h.memory()
        m["total"] = m["weights"] + m["caches"] + m["workspace"]
        return m

    @property
    def cuda_stream(self):
        """The cudaStream_t (int) the engine queues on; 0 for the cpu backend."""
        return self._h.cuda_stream()


@dataclasses.dataclass
class Plan:
    """What `dsv4 plan` prints: the layers' roles and the KV bytes of a sequence per format set."""
    config: Config
    layers: list
    context: int
    kv_bytes: dict  # format set name -> bytes one sequence of `context` tokens holds

    def sequences_that_fit(self, memory_bytes, kv_format="v4.1-native"):
        return memory_bytes // self.kv_bytes[kv_format]

    def __str__(self):
        lines = [repr(self.config), f"{'layer':>5} {'kind':<10} {'ratio':>5} {'kv_src':>6} {'idx_src':>7} roles"]
        for p in self.layers:
            roles = [r for r, on in (("compressor", p.owns_compressor), ("index_keys", p.owns_index_keys),
                                     ("indexer", p.owns_indexer), ("candidates", p.is_candidate_source),
                                     ("mtp", p.is_mtp)) if on]
            lines.append(f"{p.layer:>5} {p.kind:<10} {p.compress_ratio:>5} {p.kv_source:>6} {p.index_source:>7} "
                         f"{' '.join(roles) or '-'}")
        for name, b in self.kv_bytes.items():
            lines.append(f"KV bytes for {self.context} tokens, {name}: {b} ({b / self.context:.1f} B/token)")
        return "\n".join(lines)


def plan(config, context=4096, kv_formats=("v4.1-native", "fp8_ds_mla", "bf16", "fp8")):
    """The layer plan of `config` (a Config, a preset name or a config path) and the KV bytes one
    sequence of `context` tokens holds with each format set."""
    if not isinstance(config, Config):
        config = Config.load(config)
    return Plan(config, config.layers, context, {f: config.kv_bytes(context, f) for f in kv_formats})
