"""Qwen3.5's multi-token-prediction (MTP) head: one extra full-attention decoder layer that drafts the token after
next from the main model's hidden state and the next token's embedding, as a pure function over the ragged batch.

Never samples, drafts in a loop or touches devices: the engine's draft/verify step (issue 32) calls `mtp_forward`.

How the head runs, as read in vLLM and SGLang (the checkpoint carries no modelling code of its own):
- Input hidden states: the main model's last hidden states *after* its final norm. vLLM's Qwen3NextModel.forward
  (models/qwen3_next.py, which Qwen3.5 reuses) ends with `self.norm(hidden_states, residual)`, its compute_logits
  applies the LM head to that output with no further norm, and the proposer (v1/spec_decode/llm_base_proposer.py,
  set_inputs_first_pass) hands the same tensor to the head as `target_hidden_states`.
- fc input order: `cat([pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])`, embedding first
  (vLLM qwen3_5_mtp.py Qwen3_5MultiTokenPredictor.forward; SGLang qwen3_next_mtp.py Qwen3NextForCausalLMMTP.forward,
  `torch.cat((input_embeds, hidden_states))`); `mtp.fc.weight` is torch [H, 2H], so our `fc` is [2H, H] with the
  embedding's rows first.
- Norms: every MTP RMSNorm (pre_fc_norm_embedding, pre_fc_norm_hidden, the layer's, `mtp.norm`) is Qwen3_5RMSNorm,
  i.e. GemmaRMSNorm in vLLM and SGLang, scaling by (1 + w) like the main layers (cfg.norm_plus_one).
- Output: `mtp.norm` is applied to the layer's output; the LM head (shared with the main model, as is the
  embedding) reads that normed state directly, and the next draft step feeds that same normed state back in as
  its `hidden` (llm_base_proposer: for method "mtp" the model returns one tensor that is both the logits' input and
  the next step's hidden state). We call the head's output norm `final_norm` (the checkpoint's `mtp.norm`).
- Positions: vLLM shifts the input ids left by one and leaves the positions unchanged ("rotate the input ids and
  leave the positions unchanged", set_inputs_first_pass): token i of the head pairs hidden state h_i (of the main
  model's token at position p_i) with the embedding of token i+1, runs at position p_i, writes its KV at p_i's
  slot, and its logits predict the token at p_i + 2 (not position i + 1: the head's position is its hidden
  state's). So the first draft step's `batch` is the main step's own ragged batch (same positions, block tables)
  and `tokens` are its tokens shifted by one within each request, the last one replaced by the token just sampled.
  Each further draft step is one token per request at the previous step's position + 1 (vLLM: positions += 1),
  fed the token just drafted and the previous step's output as `hidden`.
- KV cache: the head's layer has an attention module of its own (vLLM: `mtp.layers.0.self_attn`), so it has KV
  pages of its own (`cache["mtp"]`), here over the same block tables as the main model's attention layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen_jax.config import FULL_ATTENTION, ModelConfig
from qwen_jax.layers.batch import Ragged
from qwen_jax.layers.hot_ops import Ops
from qwen_jax.models.decoder import layer_call, lm_head


def next_tokens_in_request(tokens: jax.Array, batch: Ragged, following: jax.Array) -> jax.Array:
    """The head's `tokens` for a step of the main model: each token's successor in its request, [T] -> [T], where
    the last token of request r is followed by following[r] ([R]: the token sampled after it, or for a prefill
    chunk that ends inside its prompt, the prompt's next token). Padding tokens get 0."""
    index = jnp.arange(tokens.shape[0])
    request = batch.token_request
    last = batch.query_start[request] + batch.query_len[request] - 1
    successor = tokens[jnp.minimum(index + 1, tokens.shape[0] - 1)]
    return jnp.where(batch.token_valid, jnp.where(index == last, following[request], successor), 0)


def mtp_forward(params: dict, cache: dict, hidden: jax.Array, tokens: jax.Array, batch: Ragged, cfg: ModelConfig,
                ops: Ops, sample_index: jax.Array | None = None, draft_len: int = 0
                ) -> tuple[jax.Array, jax.Array, dict]:
    """One MTP step over a ragged batch. hidden: [T, H] main-model hidden states after its final norm (or the
    previous MTP step's output); tokens: [T] the token following each hidden state's token; batch: positions of the
    hidden states' tokens (draft_len > 0: speculative verify rows of draft_len + 1 tokens, as decoder.forward's).
    Returns (float32 logits [R, V] of the tokens `sample_index` (all T when None), the head's
    output [T, H] after its final norm (the next draft step's `hidden`; with sample_index, only those rows: the
    others' MoE is skipped, as only their KV pages are needed), the cache with the head's KV pages updated)."""
    if not cfg.has_mtp:
        raise ValueError("mtp_forward: this model has no MTP head (cfg.num_mtp_layers is 0)")
    head = params["mtp"]
    eps, plus_one = cfg.rms_norm_eps, cfg.norm_plus_one
    embedded = ops.norm(params["embed"][tokens], head["pre_fc_norm_embedding"], eps, plus_one)
    hidden = ops.norm(hidden, head["pre_fc_norm_hidden"], eps, plus_one)
    x = ops.dense(jnp.concatenate([embedded, hidden], axis=-1), head["fc"]).astype(embedded.dtype)
    read = None if sample_index is None else \
        jnp.zeros(tokens.shape[0], bool).at[sample_index].set(True) & batch.token_valid
    x, pages = layer_call(x, head["layer"], cache["mtp"], batch, cfg=cfg, mixer=FULL_ATTENTION, moe=cfg.mtp_is_moe,
                          ops=ops, draft_len=draft_len, moe_rows=read)
    out = ops.norm(x, head["final_norm"], eps, plus_one)
    logits = lm_head(out if sample_index is None else out[sample_index], params, cfg)
    return logits, out, {**cache, "mtp": pages}
