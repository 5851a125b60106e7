"""The engine-evaluation adapter: `create_engine` loads a checkpoint (weights.open_checkpoint) and serves prefill /
decode / remove of named requests with the engine's own parts: its forward program (engine/step.py) on flat ragged
batches, its block and slot pools (engine/memory.py) and its cache layout (sharding/rules.py). It keeps only which
request holds which blocks and slot, and hands the last tokens' logits back.

No scheduling, sampling or sharding here, and never a host copy of the logits when the caller hands in device tensors.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.config import ModelConfig, from_hf_dict
from qwen_jax.engine import buckets, step
from qwen_jax.engine.memory import BlockPool, SlotPool
from qwen_jax.layers.batch import ragged
from qwen_jax.layers.hot_ops import resolve_kernels
from qwen_jax.weights import dummy_params, load_params, open_checkpoint, resolve_mtp
from sharding import rules
from sharding.mesh import make_mesh

_MIN_TOKENS_BUCKET = 16


@dataclass
class _Request:
    slot: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens already in the cache


class Engine:
    """Named requests on one device. Every call takes a batch of request ids and returns float32 logits
    [batch, vocab] of each request's last token (a torch tensor when the inputs were torch tensors)."""

    def __init__(self, cfg: ModelConfig, params: dict, device: jax.Device, max_num_seqs: int = 8,
                 max_model_len: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 8192,
                 kernels: str = "reference"):
        self.cfg = cfg
        self.kernels = resolve_kernels(kernels)  # "gpu": the kernels of pallas_kernels/ (qwen_jax/layers/hot_ops.py)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.params = params
        self.device = device
        self.mesh = make_mesh(1, devices=[device])
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.block_size = block_size
        self.blocks_per_seq = math.ceil(self.max_model_len / block_size)
        self.blocks = BlockPool(max_num_seqs * self.blocks_per_seq + 1, block_size)
        self.slots = SlotPool(max_num_seqs + 1)
        self.cache = rules.init_cache(cfg, self.mesh, self.blocks.num_blocks, block_size, self.slots.num_slots)
        self._no_tokens = jax.device_put(np.zeros(1, np.int32), device)  # no token comes from a previous step
        self.requests: dict[Hashable, _Request] = {}

    # ---- public API --------------------------------------------------------------------------------------
    def prefill(self, request_ids: Sequence[Hashable], input_ids: Sequence) -> object:
        """Run each request's prompt (a 1-D token tensor; lengths may differ) from position 0. A request id
        that is already live is replaced: its blocks and slot are freed first. Returns last-token logits."""
        request_ids = self._check_ids(request_ids)
        prompts = [_to_numpy(t).reshape(-1) for t in input_ids]
        if len(prompts) != len(request_ids):
            raise ValueError(f"got {len(request_ids)} request ids but {len(prompts)} prompts")
        for rid, prompt in zip(request_ids, prompts, strict=True):
            if not 0 < prompt.size <= self.max_model_len:
                raise ValueError(f"request {rid!r}: prompt of {prompt.size} tokens; must be 1..{self.max_model_len}")
        self.remove([rid for rid in request_ids if rid in self.requests])
        new = []
        try:
            for rid, prompt in zip(request_ids, prompts, strict=True):
                req = _Request(slot=self.slots.allocate())
                new.append(rid)
                self.requests[rid] = req
                req.blocks = self.blocks.allocate(self.blocks.blocks_for(prompt.size))
        except Exception:
            self.remove(new)
            raise
        # At most max_num_batched_tokens tokens per forward (the reference MoE and attention need temporaries that
        # grow with tokens x experts and tokens x context), whole prompts each.
        groups, group, size = [], [], 0
        for rid, prompt in zip(request_ids, prompts, strict=True):
            if group and size + prompt.size > self.max_num_batched_tokens:
                groups.append(group)
                group, size = [], 0
            group.append((rid, prompt))
            size += prompt.size
        groups.append(group)
        logits = jnp.concatenate([self._run([rid for rid, _ in g], [p for _, p in g], [0] * len(g)) for g in groups])
        for rid, prompt in zip(request_ids, prompts, strict=True):
            self.requests[rid].length = prompt.size
        return _like(logits, input_ids[0])

    def decode(self, request_ids: Sequence[Hashable], token_ids) -> object:
        """Append one token per request (token_ids: [batch] or [batch, 1]) and return the next logits."""
        request_ids = self._check_ids(request_ids)
        tokens = _to_numpy(token_ids)
        if tokens.ndim == 2 and tokens.shape[1] == 1:
            tokens = tokens[:, 0]
        if tokens.shape != (len(request_ids),):
            raise ValueError(f"token_ids must be [batch] or [batch, 1] with batch={len(request_ids)}, "
                             f"got shape {tokens.shape}")
        reqs = [self._get(rid) for rid in request_ids]
        for rid, req in zip(request_ids, reqs, strict=True):
            if req.length >= self.max_model_len:
                raise ValueError(f"request {rid!r} is at max_model_len={self.max_model_len}")
        for req in reqs:
            if req.length == len(req.blocks) * self.block_size:
                req.blocks += self.blocks.allocate(1)
        starts = [req.length for req in reqs]
        logits = self._run(request_ids, [t[None] for t in tokens.astype(np.int32)], starts)
        for req in reqs:
            req.length += 1
        return _like(logits, token_ids)

    def remove(self, request_ids: Sequence[Hashable]) -> None:
        """Free the blocks and slot of each request."""
        for rid in self._check_ids(request_ids, allow_empty=True):
            self._get(rid)
        for rid in request_ids:
            req = self.requests.pop(rid)
            self.blocks.release(req.blocks)
            self.slots.release(req.slot)

    # ---- internals ---------------------------------------------------------------------------------------
    def _check_ids(self, request_ids: Sequence[Hashable], allow_empty: bool = False) -> list:
        request_ids = list(request_ids)
        if not request_ids and not allow_empty:
            raise ValueError("empty batch: pass at least one request id")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"duplicate request ids in one batch: {request_ids}")
        if len(request_ids) > self.max_num_seqs:
            raise ValueError(f"batch of {len(request_ids)} requests exceeds max_num_seqs={self.max_num_seqs}")
        return request_ids

    def _get(self, rid: Hashable) -> _Request:
        if rid not in self.requests:
            raise KeyError(f"unknown request id {rid!r} (never prefilled, or removed)")
        return self.requests[rid]

    def _run(self, request_ids: list, tokens: list[np.ndarray], starts: list[int]) -> jax.Array:
        """Run each request's new tokens from its start position as one flat ragged batch (tokens padded to a
        power of two, requests to a power of two up to max_num_seqs: padding uses slot 0 and block 0) through the
        engine's step program; the logits of each request's last token."""
        lens = [len(t) for t in tokens]
        num_tokens = buckets.bucket(sum(lens), _MIN_TOKENS_BUCKET)
        num_requests = min(buckets.bucket(len(request_ids)), buckets.bucket(self.max_num_seqs))
        reqs = [self.requests[rid] for rid in request_ids]
        batch = ragged(starts, lens, [r.slot for r in reqs], [r.blocks for r in reqs], num_tokens, num_requests,
                       self.blocks_per_seq)
        flat = np.zeros(num_tokens, np.int32)
        flat[:sum(lens)] = np.concatenate(tokens)
        buffer, layout = step.pack_inputs(flat, batch)
        logits, self.cache = step.forward(self.params, self.cache, self._no_tokens,
                                          jax.device_put(buffer, self.device), layout=layout, cfg=self.cfg,
                                          mesh=self.mesh, kernels=self.kernels)
        return logits[:len(request_ids)]


def _to_numpy(x) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _like(logits: jax.Array, example) -> object:
    """Torch in, torch out (zero-copy via DLPack, then moved to the input's device if that differs)."""
    if not type(example).__module__.startswith("torch"):
        return logits
    import torch
    import torch.utils.dlpack

    out = torch.utils.dlpack.from_dlpack(logits)
    return out if out.device == example.device else out.to(example.device)


def _resolve_device(device: str) -> jax.Device:
    if device == "cpu":
        return jax.devices("cpu")[0]
    if device == "auto":
        return jax.devices()[0]
    if device == "cuda":
        try:
            return jax.devices("gpu")[0]
        except RuntimeError as exc:
            raise RuntimeError(f"device='cuda' was requested but JAX has no GPU backend ({exc}); "
                               f"install jax[cuda12] or pass device='cpu'") from None
    raise ValueError(f"unknown device {device!r}: use 'cuda', 'cpu' or 'auto'")


def create_engine(model_config: dict | None, weight_dir: str | None, device: str = "cuda", load_format: str = "auto",
                  seed: int = 0, **engine_kwargs) -> Engine:
    """Load `weight_dir` (HF safetensors dir, a dir with the native `model.pt`, or a llama2.c `.bin` / a dir
    holding one) for `model_config` (an HF config dict or the native dict) onto `device` ('cuda', 'cpu' or
    'auto'); with load_format "dummy", random weights of `model_config`'s shapes drawn from `seed` instead
    (`weight_dir` unused).
    `engine_kwargs`: max_num_seqs, max_model_len, block_size, max_num_batched_tokens, kernels."""
    jax_device = _resolve_device(device)
    if load_format == "dummy":
        if model_config is None:
            raise ValueError("load_format 'dummy' needs model_config: the shapes come from it")
        cfg = from_hf_dict(model_config)
        with jax.default_device(jax_device):
            return Engine(cfg, dummy_params(cfg, seed), jax_device, **engine_kwargs)
    if load_format != "auto":
        raise ValueError(f"load_format {load_format!r}: expected 'auto' or 'dummy'")
    config, source = open_checkpoint(weight_dir, model_config)
    cfg = resolve_mtp(from_hf_dict(config), source)
    params = load_params(cfg, source, place=lambda path, a: jax.device_put(a, jax_device))
    return Engine(cfg, params, jax_device, **engine_kwargs)
