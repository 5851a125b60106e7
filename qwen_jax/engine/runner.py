"""ModelRunner: turns a StepPlan into padded device batches, runs the jitted forward + sampler with the cache
donated, and moves recurrent-state snapshots for the prefix cache.

Owns the device arrays (params, cache, snapshots). Shapes are bucketed to powers of two so that steady serving
reuses a few compiled programs; it never decides who runs (the scheduler does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.config import FULL_ATTENTION, ModelConfig
from qwen_jax.engine.sampler import SampleOutput, SamplingTensors, sample
from qwen_jax.engine.scheduler import Row
from qwen_jax.models.decoder import cache_shapes, decoder_layer, logits_head, prepare_batch
from qwen_jax.sampling_params import SamplingParams

# Every step with a row asking for logprobs computes the API maximum of top-n (one compiled width, not 21).
TOP_LOGPROBS_WIDTH = SamplingParams.MAX_LOGPROBS


def bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


# A step runs as separately compiled programs, embed -> one per layer -> head + sampler, dispatched from Python.
# Layers of the same kind share one compiled program per shape bucket, so compile time does not grow with depth
# (40 layers compiled as one program took 27 s on an H200; one layer about 0.6 s). Dispatch is asynchronous, so the
# per-layer launches overlap the device work of the layers before them.
@jax.jit
def _embed(embed, batch):
    return embed[batch["tokens"]]


@functools.partial(jax.jit, static_argnames=("cfg", "index"), donate_argnums=(2,))
def _layer(x, p, c, batch, cfg, index):
    return decoder_layer(x, p, c, batch, cfg, index)


@functools.partial(jax.jit, static_argnames=("cfg", "num_top_logprobs"))
def _head_sample(x, head_params, batch, tensors, cfg, num_top_logprobs):
    return sample(logits_head(x, head_params, batch, cfg), tensors, num_top_logprobs)


def run_step(params: dict, cache: dict, batch: dict, tensors: SamplingTensors, cfg: ModelConfig,
             num_top_logprobs: int) -> tuple[SampleOutput, dict]:
    """forward + sample for one padded batch; the cache's per-layer buffers are donated layer by layer."""
    batch = jax.device_put(prepare_batch(batch))
    x = _embed(params["embed"], batch)
    layers = []
    for i, (p, c) in enumerate(zip(params["layers"], cache["layers"])):
        x, c = _layer(x, p, c, batch, cfg=cfg, index=_layer_index(cfg, i))
        layers.append(c)
    head = {k: params[k] for k in ("embed", "final_norm", "lm_head") if k in params}
    return _head_sample(x, head, batch, tensors, cfg=cfg, num_top_logprobs=num_top_logprobs), {"layers": layers}


def _layer_index(cfg: ModelConfig, i: int) -> int:
    """The first layer with the same kind (mixer type, MoE or dense) as layer i: layers of one kind compile once."""
    kind = (cfg.layer_types[i], cfg.is_moe_layer(i))
    return next(j for j in range(cfg.num_layers) if (cfg.layer_types[j], cfg.is_moe_layer(j)) == kind)


def _gdn_layers(tree: dict, cfg: ModelConfig) -> list[dict]:
    return [c for c, kind in zip(tree["layers"], cfg.layer_types) if kind != FULL_ATTENTION]


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=(0,))
def _restore_snapshots(cache, snapshots, src, dst, cfg):
    """cache slots[dst] <- snapshots[src] for every recurrent layer (padding pairs write slot 0, the sink)."""
    layers = list(cache["layers"])
    gdn = [i for i, kind in enumerate(cfg.layer_types) if kind != FULL_ATTENTION]
    for i, snap in zip(gdn, snapshots):
        layers[i] = {k: v.at[dst].set(snap[k][src]) for k, v in layers[i].items()}
    return {"layers": layers}


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=(1,))
def _save_snapshots(cache, snapshots, src, dst, cfg):
    """snapshots[dst] <- cache slots[src] (padding pairs write snapshot 0, the sink)."""
    return [{k: v.at[dst].set(layer[k][src]) for k, v in snap.items()}
            for snap, layer in zip(snapshots, _gdn_layers(cache, cfg))]


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict, num_blocks: int, block_size: int, num_slots: int,
                 num_snapshots: int, max_num_seqs: int, max_model_len: int, vocab_size: int,
                 eos_token_ids: list[int], seed: int = 0, place_cache=None):
        self.cfg = cfg
        self.params = params
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.step_seed = seed * 1_000_003
        shapes = cache_shapes(cfg, num_blocks, block_size, num_slots)
        zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
        self.cache = place_cache(shapes) if place_cache else jax.tree.map(zeros, shapes)
        self.snapshots = None
        if num_snapshots and cfg.is_hybrid:
            snap_shapes = cache_shapes(cfg, 1, block_size, num_snapshots + 1)  # + the sink at 0
            self.snapshots = jax.tree.map(zeros, _gdn_layers(snap_shapes, cfg))

    # ---- batches -------------------------------------------------------------------------------------------
    def _table_width(self, rows: list[Row]) -> int:
        needed = max(len(r.seq.block_table) for r in rows)
        return min(self.max_blocks_per_seq, bucket(needed, max(1, self.max_blocks_per_seq // 8)))

    def _batch(self, rows: list[Row], batch_size: int, seq_len: int) -> dict:
        width = self._table_width(rows)
        tokens = np.zeros((batch_size, seq_len), np.int32)
        starts = np.zeros(batch_size, np.int32)
        lens = np.zeros(batch_size, np.int32)
        slots = np.zeros(batch_size, np.int32)
        tables = np.zeros((batch_size, width), np.int32)
        for i, r in enumerate(rows):
            ids = r.seq.all_token_ids[r.start:r.start + r.num_tokens]
            tokens[i, :len(ids)] = ids
            starts[i], lens[i] = r.start, r.num_tokens
            slots[i] = r.seq.slot or 0
            tables[i, :len(r.seq.block_table)] = r.seq.block_table
        positions = starts[:, None] + np.arange(seq_len, dtype=np.int32)[None]
        return {"tokens": tokens, "positions": positions, "seq_lens": lens, "state_slots": slots,
                "block_tables": tables, "context_lens": starts + lens}

    def _sampling(self, rows: list[Row], batch_size: int, histories: dict) -> SamplingTensors:
        self.step_seed += 1
        return SamplingTensors.build(
            [r.seq.params for r in rows], [len(r.seq.output_token_ids) for r in rows],
            [histories.get(r.seq.request_id) for r in rows], vocab_size=self.vocab_size, batch_size=batch_size,
            eos_token_ids=self.eos_token_ids, step_seed=self.step_seed)

    # ---- execution -------------------------------------------------------------------------------------------
    def run(self, decode: list[Row], prefill: list[Row], histories: dict, max_batched_tokens: int
            ) -> list[tuple[Row, SampleOutput, int]]:
        """Run one step. Returns (row, its group's SampleOutput on the host, index of the row in it) per row."""
        self._restore([r for r in decode + prefill if r.restore_snapshot is not None])
        groups = []
        if decode:
            groups.append((decode, 1))
        if prefill:
            seq_len = bucket(max(r.num_tokens for r in prefill), 16)
            per_call = max(1, max_batched_tokens // seq_len)
            for i in range(0, len(prefill), per_call):
                groups.append((prefill[i:i + per_call], seq_len))
        results = []
        pending = []
        for rows, seq_len in groups:
            batch_size = bucket(len(rows))
            batch = self._batch(rows, batch_size, seq_len)
            tensors = self._sampling(rows, batch_size, histories)
            top = max((r.seq.params.logprobs or 0) for r in rows)
            num_top = 0 if top == 0 else TOP_LOGPROBS_WIDTH
            out, self.cache = run_step(self.params, self.cache, batch, tensors, self.cfg, num_top)
            pending.append((rows, out))
        self._save([r for r in decode + prefill if r.save_snapshot is not None])
        for rows, out in pending:
            host = SampleOutput(*jax.device_get(tuple(out)))
            results += [(r, host, i) for i, r in enumerate(rows)]
        return results

    def _pairs(self, rows: list[Row], attr: str) -> tuple[np.ndarray, np.ndarray]:
        n = bucket(len(rows))
        src, dst = np.zeros(n, np.int32), np.zeros(n, np.int32)
        for i, r in enumerate(rows):
            if attr == "restore":
                src[i], dst[i] = r.restore_snapshot, r.seq.slot
            else:
                src[i], dst[i] = r.seq.slot, r.save_snapshot
        return src, dst

    def _restore(self, rows: list[Row]) -> None:
        if rows and self.snapshots is not None:
            src, dst = self._pairs(rows, "restore")
            self.cache = _restore_snapshots(self.cache, self.snapshots, src, dst, cfg=self.cfg)

    def _save(self, rows: list[Row]) -> None:
        if rows and self.snapshots is not None:
            src, dst = self._pairs(rows, "save")
            self.snapshots = _save_snapshots(self.cache, self.snapshots, src, dst, cfg=self.cfg)
