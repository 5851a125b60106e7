"""Memory roofline of a decode step and FLOPs of a prefill token for any ModelConfig, and measured/roofline ratios.

Pure arithmetic over `param_shapes` (the decoder's single source of truth for weights): never touches a device.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from qwen_jax.config import FULL_ATTENTION, ModelConfig, load_config
from qwen_jax.models.decoder import param_shapes

H200_TBPS = 4.3  # measured device-to-device copy bandwidth of one H200, TB/s
H100_TBPS = 3.0
BANDWIDTHS_TBPS = {"h200": H200_TBPS, "h100": H100_TBPS}

_EXPERT_LEAVES = ("w_gate", "w_up", "w_down")  # in a MoE layer these carry a leading [E] axis
_SHARED_LEAVES = ("shared_gate", "shared_up", "shared_down", "shared_expert_gate")


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected number of distinct experts a batch of `batch` tokens touches in one MoE layer when each token
    picks `top_k` of `num_experts` uniformly: E * (1 - (1 - k/E)^B)."""
    if num_experts == 0 or batch == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclasses.dataclass(frozen=True)
class DecodeBytes:
    """Bytes moved by one decode step of `batch` sequences, split by where they come from."""

    batch: int
    dense_weights: int  # attention / GDN projections, norms, router, dense MLPs, embedding rows read
    lm_head: int  # the full LM head (the tied embedding when tied)
    shared_experts: int
    routed_experts: float  # expected distinct experts touched x bytes per expert, summed over MoE layers
    kv_cache: int  # K and V read for every cached position plus the new token's write
    recurrent_state: int  # GDN fp32 delta-rule state, read and written
    conv_state: int  # GDN conv window, read and written

    @property
    def weights(self) -> float:
        return self.dense_weights + self.lm_head + self.shared_experts + self.routed_experts

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.recurrent_state + self.conv_state

    def seconds(self, bandwidth_tbps: float = H200_TBPS) -> float:
        """Roofline time of the step at `bandwidth_tbps` TB/s."""
        return self.total / (bandwidth_tbps * 1e12)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "weights": self.weights, "total": self.total}


def _leaf_bytes(s: jax.ShapeDtypeStruct) -> int:
    return int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize


def decode_bytes(cfg: ModelConfig, batch: int, context_lens: int | Sequence[int] = 0) -> DecodeBytes:
    """Bytes one decode step of `batch` sequences reads and writes. `context_lens` is the number of tokens
    already cached per sequence (one int for all, or one per sequence). Activations are ignored."""
    lens = [int(context_lens)] * batch if isinstance(context_lens, int) else [int(c) for c in context_lens]
    if len(lens) != batch:
        raise ValueError(f"{len(lens)} context lengths for a batch of {batch}")
    shapes = param_shapes(cfg)
    itemsize = np.dtype(cfg.dtype).itemsize
    distinct = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)

    embed_row = cfg.hidden_size * itemsize
    lm_head = _leaf_bytes(shapes["lm_head"] if "lm_head" in shapes else shapes["embed"])
    dense = _leaf_bytes(shapes["final_norm"])
    dense += 0 if cfg.tie_word_embeddings else batch * embed_row  # the tied table is already counted as the head
    shared = 0
    routed = 0.0
    for i, layer in enumerate(shapes["layers"]):
        dense += _leaf_bytes(layer["input_norm"]) + _leaf_bytes(layer["post_norm"])
        dense += sum(_leaf_bytes(s) for s in layer["mixer"].values())
        for name, s in layer["mlp"].items():
            if cfg.is_moe_layer(i) and name in _EXPERT_LEAVES:
                routed += _leaf_bytes(s) / cfg.num_experts * distinct
            elif name in _SHARED_LEAVES:
                shared += _leaf_bytes(s)
            else:
                dense += _leaf_bytes(s)

    kv_per_token = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize  # K and V of one layer
    n_attn = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    n_gdn = len(cfg.linear_layers)
    kv = n_attn * kv_per_token * (sum(lens) + batch)
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * itemsize
    return DecodeBytes(
        batch=batch,
        dense_weights=dense,
        lm_head=lm_head,
        shared_experts=shared,
        routed_experts=routed,
        kv_cache=kv,
        recurrent_state=2 * n_gdn * batch * state,
        conv_state=2 * n_gdn * batch * conv,
    )


def prefill_flops_per_token(cfg: ModelConfig, prompt_len: int) -> float:
    """Average FLOPs per token of prefilling one `prompt_len`-token prompt: 2 x active matmul weights (top-k plus
    shared experts in MoE layers; norms and biases ignored), causal attention scores and values
    (4 * heads * head_dim * mean context), the Gated DeltaNet recurrence (about 6 * nv * dk * dv per token:
    decay+update, k^T S, q S), and the LM head for the last token only, spread over the prompt."""
    shapes = param_shapes(cfg)
    matmul = 0.0
    for i, layer in enumerate(shapes["layers"]):
        for s in layer["mixer"].values():
            if len(s.shape) >= 2:  # projections and the depthwise conv (2 * kernel * channels per token)
                matmul += float(np.prod(s.shape))
        for name, s in layer["mlp"].items():
            n = float(np.prod(s.shape))
            if cfg.is_moe_layer(i) and name in _EXPERT_LEAVES:
                n *= cfg.num_experts_per_tok / cfg.num_experts
            matmul += n
    flops = 2.0 * matmul
    mean_context = (prompt_len + 1) / 2
    flops += len(cfg.attention_layers) * 4.0 * cfg.num_heads * cfg.head_dim * mean_context
    flops += len(cfg.linear_layers) * 6.0 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * \
        cfg.linear_value_head_dim
    flops += 2.0 * cfg.hidden_size * cfg.vocab_size / max(prompt_len, 1)
    return flops


def roofline_ratio(measured_s: float, bytes_moved: float, bandwidth_tbps: float = H200_TBPS) -> float:
    """measured time / roofline time; 1.0 means the step ran at the bandwidth bound, 2.0 twice as slow."""
    return measured_s / (bytes_moved / (bandwidth_tbps * 1e12))


def format_ratio(measured_s: float, bytes_moved: float, bandwidth_tbps: float = H200_TBPS) -> str:
    """One printable line comparing a measured step time with its roofline."""
    bound = bytes_moved / (bandwidth_tbps * 1e12)
    ratio = roofline_ratio(measured_s, bytes_moved, bandwidth_tbps)
    return (f"measured {measured_s * 1e3:.3f} ms vs roofline {bound * 1e3:.3f} ms "
            f"({bytes_moved / 1e9:.3f} GB at {bandwidth_tbps} TB/s): {ratio:.2f}x")


def table(cfg: ModelConfig, batches: Sequence[int], context: int, bandwidth_tbps: float) -> list[dict]:
    """One row per batch size: the byte breakdown (GB), roofline ms per step and the decode tok/s bound."""
    rows = []
    for b in batches:
        d = decode_bytes(cfg, b, context)
        ms = d.seconds(bandwidth_tbps) * 1e3
        rows.append({
            "batch": b,
            "weights_gb": d.weights / 1e9,
            "experts_touched": expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, b),
            "kv_gb": d.kv_cache / 1e9,
            "state_gb": (d.recurrent_state + d.conv_state) / 1e9,
            "total_gb": d.total / 1e9,
            "roofline_ms": ms,
            "max_decode_tok_s": b / (ms / 1e3),
        })
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="HF config.json or a model directory")
    p.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=2048, help="cached tokens per sequence")
    p.add_argument("--bandwidth", type=float, default=H200_TBPS, help="TB/s (4.3 measured H200, 3.0 H100)")
    p.add_argument("--prompt-len", type=int, default=2048, help="prompt length for the prefill FLOPs figure")
    p.add_argument("--measured-ms", type=float, default=None, help="a measured decode step (ms) at the first batch")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    batches = [int(b) for b in args.batch.split(",")]
    print(f"{args.config}: {cfg.num_layers} layers, context {args.context}, {args.bandwidth} TB/s")
    header = f"{'batch':>6} {'weights GB':>11} {'experts':>8} {'KV GB':>8} {'state GB':>9} {'total GB':>9} " \
             f"{'ms/step':>8} {'max tok/s':>10}"
    print(header)
    for r in table(cfg, batches, args.context, args.bandwidth):
        print(f"{r['batch']:>6} {r['weights_gb']:>11.3f} {r['experts_touched']:>8.1f} {r['kv_gb']:>8.3f} "
              f"{r['state_gb']:>9.3f} {r['total_gb']:>9.3f} {r['roofline_ms']:>8.3f} {r['max_decode_tok_s']:>10.0f}")
    flops = prefill_flops_per_token(cfg, args.prompt_len)
    print(f"prefill: {flops / 1e9:.2f} GFLOP per token at prompt length {args.prompt_len}")
    if args.measured_ms is not None:
        d = decode_bytes(cfg, batches[0], args.context)
        print(format_ratio(args.measured_ms / 1e3, d.total, args.bandwidth))


if __name__ == "__main__":
    main()
