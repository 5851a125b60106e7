"""The native `model.pt` format in float16 through create_engine, against a plain-torch reference written from the
format's description: interleaved (even, odd) RoPE pairs, float32 softmax and RMSNorm variance.

The reference never calls qwen_jax code; it recomputes the whole sequence at every step.
"""

from __future__ import annotations

import numpy as np
import torch

from qwen_jax import create_engine

CONFIG = {"model_type": "tiny_llama", "torch_dtype": "float16", "vocab_size": 96, "hidden_size": 64,
          "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
TOL = 5e-3  # max rel err of float16 logits


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, n, kv, d = 64, 160, 4, 2, 16
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.1).half()  # noqa: E731
    norm = lambda: (1.0 + torch.randn(h, generator=g) * 0.1).half()  # noqa: E731
    state = {"embed_tokens.weight": rand(96, h), "norm.weight": norm(), "lm_head.weight": rand(96, h)}
    for i in range(2):
        p = f"layers.{i}."
        state.update({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": rand(n * d, h), p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h), p + "self_attn.o_proj.weight": rand(h, n * d),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        })
    return state


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + CONFIG["rms_norm_eps"])).half()


def _rope(x: torch.Tensor) -> torch.Tensor:
    """x: [S, heads, d]; rotates pairs (2i, 2i+1) by position * theta^(-2i/d), in float32."""
    seq, _, d = x.shape
    freqs = CONFIG["rope_theta"] ** (-torch.arange(0, d, 2).float() / d)
    angle = torch.arange(seq).float()[:, None] * freqs[None]  # [S, d/2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).reshape(x.shape).half()


@torch.no_grad()
def _reference_last_logits(state: dict, tokens: list[int]) -> torch.Tensor:
    n, kv, d = 4, 2, 16
    x = state["embed_tokens.weight"][torch.tensor(tokens)]  # [S, H] float16
    seq = x.shape[0]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for i in range(2):
        p = f"layers.{i}."
        h = _rms_norm(x, state[p + "input_layernorm.weight"])
        q = _rope((h @ state[p + "self_attn.q_proj.weight"].T).view(seq, n, d))
        k = _rope((h @ state[p + "self_attn.k_proj.weight"].T).view(seq, kv, d))
        v = (h @ state[p + "self_attn.v_proj.weight"].T).view(seq, kv, d)
        k, v = k.repeat_interleave(n // kv, dim=1), v.repeat_interleave(n // kv, dim=1)
        scores = torch.einsum("snd,tnd->nst", q, k).float() * d ** -0.5
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).half()
        attn = torch.einsum("nst,tnd->snd", probs, v).reshape(seq, n * d)
        x = x + attn @ state[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, state[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ state[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ state[p + "mlp.up_proj.weight"].T)) @ state[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x[-1], state["norm.weight"])
    return (x @ state["lm_head.weight"].T).float()


def test_native_model_pt_float16_matches_plain_torch_reference(tmp_path, rel_err):
    state = _state_dict()
    torch.save(state, tmp_path / "model.pt")
    engine = create_engine(CONFIG, str(tmp_path), device="cpu", max_num_seqs=2, max_model_len=64, block_size=8)
    assert engine.cfg.dtype == "float16" and engine.cfg.rope_interleaved
    rng = np.random.default_rng(0)
    history = {"x": list(rng.integers(0, 96, 6)), "y": list(rng.integers(0, 96, 13))}
    worst = 0.0

    def check(logits, rids):
        nonlocal worst
        for row, rid in enumerate(rids):
            err = rel_err(np.asarray(logits[row]), _reference_last_logits(state, history[rid]).numpy())
            worst = max(worst, err)
            assert err <= TOL, f"request {rid} at {len(history[rid])} tokens: max rel err {err:.2e}"

    check(engine.prefill(["x", "y"], [torch.tensor(history["x"]), torch.tensor(history["y"])]), ["x", "y"])
    for _ in range(5):
        new = rng.integers(0, 96, 2)
        for rid, t in zip(["x", "y"], new, strict=True):
            history[rid].append(int(t))
        check(engine.decode(["x", "y"], torch.tensor(new)), ["x", "y"])
    engine.remove(["x"])
    history["z"] = list(rng.integers(0, 96, 9))
    history["y"] = list(rng.integers(0, 96, 4))  # replaced by a new prompt
    check(engine.prefill(["z", "y"], [np.asarray(history["z"]), np.asarray(history["y"])]), ["z", "y"])
    for _ in range(3):
        new = rng.integers(0, 96, 2)
        for rid, t in zip(["z", "y"], new, strict=True):
            history[rid].append(int(t))
        check(engine.decode(["z", "y"], new), ["z", "y"])
    print(f"native float16: worst max rel err {worst:.2e}")
