"""Weight loading: HF safetensors directories, the native `model.pt` format, llama2.c `.bin`, and random
(`dummy`) weights, all mapped onto the params layout of `models.decoder.param_shapes` (the MTP head's `mtp.*`
tensors included, which stay at the top level in every layout, as vLLM's Qwen3_5MTP.load_weights reads them).

Tensors are read and placed one at a time (memory-mapped on the host, never a second full copy); every
missing or misshapen tensor is named in the error.

`dummy_echo` (a benchmarking aid for speculative decoding, which random weights accept no draft of): the `dummy`
weights with every residual writer zero, so the residual stream stays the token's embedding and the model's greedy
next token is a function of the current token alone, f(x) = argmax lm_head(final_norm(embed(x))); and the MTP head
set to draft that same f of the token it is fed (`echo_params`). Speculation then accepts every draft (but for
rounding), the outputs are plain decoding's, and every program costs what it costs with random weights (the same
shapes and router weights, so MoE routing is random weights' too).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qwen_jax.config import FULL_ATTENTION, ModelConfig
from qwen_jax.models.decoder import RESIDUAL_WRITERS, param_shapes, random_params

_ST_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
# Tensors of a multimodal checkpoint that the text decoder does not use.
SKIPPED_PREFIXES = ("model.visual.", "visual.")
# The MTP head's tensors (mtp.fc, mtp.pre_fc_norm_*, mtp.norm, mtp.layers.0.*), under no model prefix.
MTP_PREFIX = "mtp."

log = logging.getLogger("qwen_jax")


class WeightError(ValueError):
    """A checkpoint does not match the model config (missing tensor, wrong shape, unknown format)."""


# ---- tensor sources: name -> numpy array, lazily ------------------------------------------------------------

class TensorSource:
    def names(self) -> set[str]:
        raise NotImplementedError

    def get(self, name: str) -> np.ndarray:
        raise NotImplementedError


class DictSource(TensorSource):
    """In-memory tensors (numpy or torch), e.g. a state dict."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str) -> np.ndarray:
        return _to_numpy(self.tensors[name])


class SafetensorsSource(TensorSource):
    """One or many `.safetensors` files (with `model.safetensors.index.json` or without), memory-mapped."""

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise WeightError(f"no .safetensors files in {directory}")
        self.entries: dict[str, tuple[str, int, dict]] = {}
        for file in files:
            path = os.path.join(directory, file)
            if not os.path.exists(path):
                raise WeightError(f"{file} is listed in the index but missing from {directory}")
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for name, info in header.items():
                if name != "__metadata__":
                    self.entries[name] = (path, 8 + header_len, info)

    def names(self) -> set[str]:
        return set(self.entries)

    def get(self, name: str) -> np.ndarray:
        path, base, info = self.entries[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise WeightError(f"{name}: unsupported safetensors dtype {info['dtype']}")
        start, end = info["data_offsets"]
        count = (end - start) // np.dtype(dtype).itemsize
        data = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=(count,))
        return data.reshape(info["shape"])


class TorchFileSource(TensorSource):
    """A PyTorch state dict saved with torch.save (the native `model.pt` format), memory-mapped."""

    def __init__(self, path: str):
        import torch

        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(state, dict):
            raise WeightError(f"{path} does not hold a state dict")
        self.state = state.get("state_dict", state) if "state_dict" in state else state

    def names(self) -> set[str]:
        return set(self.state)

    def get(self, name: str) -> np.ndarray:
        return _to_numpy(self.state[name])


def _to_numpy(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    if type(t).__module__.startswith("torch"):
        import torch

        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(t)


def read_llama2c(path: str) -> tuple[dict, dict]:
    """llama2.c legacy `.bin`: (native-style config dict, HF-style state dict of numpy arrays)."""
    with open(path, "rb") as f:
        header = struct.unpack("<7i", f.read(28))
        data = np.frombuffer(f.read(), dtype="<f4")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = header
    shared = vocab > 0
    vocab = abs(vocab)
    head = dim // heads
    kv_dim = kv_heads * head
    sizes = [("embed", (vocab, dim)), ("attn_norm", (layers, dim)), ("wq", (layers, dim, dim)),
             ("wk", (layers, kv_dim, dim)), ("wv", (layers, kv_dim, dim)), ("wo", (layers, dim, dim)),
             ("ffn_norm", (layers, dim)), ("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)),
             ("w3", (layers, hidden, dim)), ("final_norm", (dim,)), ("rope", (seq_len * head,))]
    if not shared:
        sizes.append(("classifier", (vocab, dim)))
    arrays, offset = {}, 0
    for name, shape in sizes:
        count = int(np.prod(shape))
        if offset + count > data.size:
            raise WeightError(f"{path}: file ends inside tensor {name} (a truncated llama2.c checkpoint?)")
        arrays[name] = data[offset:offset + count].reshape(shape)
        offset += count
    state = {"embed_tokens.weight": arrays["embed"], "norm.weight": arrays["final_norm"]}
    if not shared:
        state["lm_head.weight"] = arrays["classifier"]
    for i in range(layers):
        p = f"layers.{i}."
        state.update({
            p + "input_layernorm.weight": arrays["attn_norm"][i],
            p + "post_attention_layernorm.weight": arrays["ffn_norm"][i],
            p + "self_attn.q_proj.weight": arrays["wq"][i], p + "self_attn.k_proj.weight": arrays["wk"][i],
            p + "self_attn.v_proj.weight": arrays["wv"][i], p + "self_attn.o_proj.weight": arrays["wo"][i],
            p + "mlp.gate_proj.weight": arrays["w1"][i], p + "mlp.down_proj.weight": arrays["w2"][i],
            p + "mlp.up_proj.weight": arrays["w3"][i],
        })
    config = {
        "model_type": "llama2c", "torch_dtype": "float32", "vocab_size": vocab, "hidden_size": dim,
        "intermediate_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head, "max_position_embeddings": seq_len,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": shared, "bos_token_id": 1,
        "eos_token_id": 1,  # run.c stops when BOS is sampled
    }
    return config, state


# ---- the mapping: our leaf <- HF tensor(s) ------------------------------------------------------------------

Plan = list[tuple[tuple, list[str], Callable[..., np.ndarray]]]


def _heads_in(n: int, d: int) -> Callable:  # [n*d, H] -> [H, n, d]
    return lambda w: w.reshape(n, d, -1).transpose(2, 0, 1)


def _heads_out(n: int, d: int) -> Callable:  # [H, n*d] -> [n, d, H]
    return lambda w: w.reshape(w.shape[0], n, d).transpose(1, 2, 0)


def _t(w: np.ndarray) -> np.ndarray:
    return w.T


def weight_plan(cfg: ModelConfig, names: set[str]) -> Plan:
    """For every params leaf: its path, the checkpoint tensors it is built from, and how."""
    prefix = _detect_prefix(names)
    plan: Plan = [(("embed",), [prefix + "embed_tokens.weight"], lambda w: w),
                  (("final_norm",), [prefix + "norm.weight"], lambda w: w)]
    if not cfg.tie_word_embeddings:
        plan.append((("lm_head",), ["lm_head.weight"], _t))
    for i, kind in enumerate(cfg.layer_types):
        plan += _layer_plan(cfg, f"{prefix}layers.{i}.", ("layers", i), kind, cfg.is_moe_layer(i), names)
    if cfg.has_mtp:
        m = MTP_PREFIX
        plan += [(("mtp", "fc"), [m + "fc.weight"], _t),  # [H, 2H] -> [2H, H]: embedding rows first
                 (("mtp", "pre_fc_norm_embedding"), [m + "pre_fc_norm_embedding.weight"], lambda w: w),
                 (("mtp", "pre_fc_norm_hidden"), [m + "pre_fc_norm_hidden.weight"], lambda w: w),
                 (("mtp", "final_norm"), [m + "norm.weight"], lambda w: w)]
        plan += _layer_plan(cfg, m + "layers.0.", ("mtp", "layer"), FULL_ATTENTION, cfg.mtp_is_moe, names)
    return plan


def _layer_plan(cfg: ModelConfig, p: str, L: tuple, kind: str, moe: bool, names: set[str]) -> Plan:
    """One decoder layer's leaves under `L` from the tensors named `p`*: its norms, mixer and MLP."""
    n, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    kd = nk * dk
    plan: Plan = [(L + ("input_norm",), [p + "input_layernorm.weight"], lambda w: w),
                  (L + ("post_norm",), [p + "post_attention_layernorm.weight"], lambda w: w)]
    m = L + ("mixer",)
    if kind == FULL_ATTENTION:
        a = p + "self_attn."
        if cfg.attn_output_gate:  # q_proj rows are [head][query d | gate d]
            for name, half in (("q", 0), ("gate", 1)):
                plan.append((m + (name,), [a + "q_proj.weight"],
                             lambda w, half=half: w.reshape(n, 2, d, -1)[:, half].transpose(2, 0, 1)))
        else:
            plan.append((m + ("q",), [a + "q_proj.weight"], _heads_in(n, d)))
        plan += [(m + ("k",), [a + "k_proj.weight"], _heads_in(kv, d)),
                 (m + ("v",), [a + "v_proj.weight"], _heads_in(kv, d)),
                 (m + ("o",), [a + "o_proj.weight"], _heads_out(n, d))]
        if cfg.qk_norm:
            plan += [(m + ("q_norm",), [a + "q_norm.weight"], lambda w: w),
                     (m + ("k_norm",), [a + "k_norm.weight"], lambda w: w)]
        if cfg.attention_bias:
            plan += [(m + ("q_bias",), [a + "q_proj.bias"], lambda w: w.reshape(n, d)),
                     (m + ("k_bias",), [a + "k_proj.bias"], lambda w: w.reshape(kv, d)),
                     (m + ("v_bias",), [a + "v_proj.bias"], lambda w: w.reshape(kv, d)),
                     (m + ("o_bias",), [a + "o_proj.bias"], lambda w: w)]
    else:
        g = p + "linear_attn."
        qkv, conv = g + "in_proj_qkv.weight", g + "conv1d.weight"  # rows/channels: [q | k | v]
        plan += [
            (m + ("q",), [qkv], lambda w: _heads_in(nk, dk)(w[:kd])),
            (m + ("k",), [qkv], lambda w: _heads_in(nk, dk)(w[kd:2 * kd])),
            (m + ("v",), [qkv], lambda w: _heads_in(nv, dv)(w[2 * kd:])),
            (m + ("z",), [g + "in_proj_z.weight"], _heads_in(nv, dv)),
            (m + ("b",), [g + "in_proj_b.weight"], _t),
            (m + ("a",), [g + "in_proj_a.weight"], _t),
            (m + ("conv_q",), [conv], lambda w: w.reshape(w.shape[0], -1)[:kd].T.reshape(-1, nk, dk)),
            (m + ("conv_k",), [conv], lambda w: w.reshape(w.shape[0], -1)[kd:2 * kd].T.reshape(-1, nk, dk)),
            (m + ("conv_v",), [conv], lambda w: w.reshape(w.shape[0], -1)[2 * kd:].T.reshape(-1, nv, dv)),
            (m + ("A_log",), [g + "A_log"], lambda w: w),
            (m + ("dt_bias",), [g + "dt_bias"], lambda w: w),
            (m + ("norm",), [g + "norm.weight"], lambda w: w),
            (m + ("out",), [g + "out_proj.weight"], _heads_out(nv, dv)),
        ]
    return plan + _mlp_plan(cfg, moe, p + "mlp.", L + ("mlp",), names)


def _mlp_plan(cfg: ModelConfig, moe: bool, p: str, m: tuple, names: set[str]) -> Plan:
    if not moe:
        return [(m + ("w_gate",), [p + "gate_proj.weight"], _t), (m + ("w_up",), [p + "up_proj.weight"], _t),
                (m + ("w_down",), [p + "down_proj.weight"], _t)]
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    plan: Plan = [(m + ("router",), [p + "gate.weight"], _t)]
    if p + "experts.gate_up_proj" in names:  # fused: gate_up [E, 2I, H], down [E, H, I]
        plan += [(m + ("w_gate",), [p + "experts.gate_up_proj"], lambda w: w[:, :inter].transpose(0, 2, 1)),
                 (m + ("w_up",), [p + "experts.gate_up_proj"], lambda w: w[:, inter:].transpose(0, 2, 1)),
                 (m + ("w_down",), [p + "experts.down_proj"], lambda w: w.transpose(0, 2, 1))]
    else:  # one tensor per expert
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            plan.append((m + (ours,), [f"{p}experts.{j}.{theirs}.weight" for j in range(e)],
                         lambda *ws: np.stack([w.T for w in ws])))
    if cfg.shared_expert_intermediate_size:
        s = p + "shared_expert."
        plan += [(m + ("shared_gate",), [s + "gate_proj.weight"], _t), (m + ("shared_up",), [s + "up_proj.weight"], _t),
                 (m + ("shared_down",), [s + "down_proj.weight"], _t),
                 (m + ("shared_expert_gate",), [p + "shared_expert_gate.weight"], _t)]
    return plan


def _detect_prefix(names: set[str]) -> str:
    for prefix in ("model.language_model.", "model.", ""):
        if prefix + "embed_tokens.weight" in names:
            return prefix
    raise WeightError("checkpoint has no embed_tokens.weight (looked for model.language_model., model. and no prefix)")


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def iter_params(cfg: ModelConfig, source: TensorSource) -> Iterator[tuple[tuple, np.ndarray]]:
    """Yield (path, host array in the model's dtype) per leaf, checking every name and shape first-come."""
    names = {n for n in source.names() if not n.startswith(SKIPPED_PREFIXES)}
    plan = weight_plan(cfg, names)
    needed = {n for _, srcs, _ in plan for n in srcs}
    missing = sorted(needed - names)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")
    shapes = param_shapes(cfg)
    for path, srcs, transform in plan:
        expected = _get(shapes, path)
        try:
            value = transform(*(source.get(n) for n in srcs))
        except ValueError as exc:  # reshape of a tensor of the wrong size
            raise WeightError(f"tensor {srcs[0]} has shape {source.get(srcs[0]).shape}, which does not fit "
                              f"{'/'.join(map(str, path))} {tuple(expected.shape)}: {exc}") from None
        if tuple(value.shape) != tuple(expected.shape):
            raise WeightError(f"tensor {srcs[0]} has shape {tuple(source.get(srcs[0]).shape)}; the config expects "
                              f"{'/'.join(map(str, path))} of shape {tuple(expected.shape)}")
        yield path, np.ascontiguousarray(value.astype(expected.dtype))


def load_params(cfg: ModelConfig, source: TensorSource, place: Callable | None = None, progress: bool = False
                ) -> dict:
    """Build the params pytree tensor by tensor. `place(path, array) -> jax.Array` puts one host array on the
    devices (sharded by the caller's rules); the default is jax.device_put to the default device."""
    place = place or (lambda path, a: jax.device_put(a))
    tree = jax.tree.map(lambda s: None, param_shapes(cfg))
    items = iter_params(cfg, source)
    if progress:
        from tqdm import tqdm

        items = tqdm(items, total=len(jax.tree.leaves(param_shapes(cfg))), desc="loading weights", unit="tensor")
    for path, value in items:
        _set(tree, path, place(path, value))
    return tree


def resolve_mtp(cfg: ModelConfig, source: TensorSource) -> ModelConfig:
    """The config a checkpoint's tensors serve: one whose config.json declares an MTP head but whose files hold no
    mtp.* tensor (a copy saved without the head) is served without it (num_mtp_layers 0, logged), so params and
    cache have no `mtp` subtree. A head with only some of its tensors fails in load_params, naming them."""
    if cfg.has_mtp and not any(name.startswith(MTP_PREFIX) for name in source.names()):
        log.warning("config.json declares %d MTP layer(s) but the checkpoint has no %s* tensors: serving without "
                    "the MTP head", cfg.num_mtp_layers, MTP_PREFIX)
        return dataclasses.replace(cfg, num_mtp_layers=0)
    return cfg


# Shape fields a given config must agree on with a llama2.c header.
_LLAMA2C_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads")


def open_checkpoint(path: str, config: dict | None = None) -> tuple[dict, TensorSource]:
    """(config dict, tensor source) of a checkpoint: a directory of HF safetensors (sharded, with their index) or
    of a native `model.pt`, or a llama2.c `.bin` (the file, or the one a directory holds). `config`: the model's
    config when the caller has one: a directory then needs no config.json, and a llama2.c header must agree with
    its shapes (the config's dtype is kept)."""
    if not os.path.exists(path):
        raise WeightError(f"{path} does not exist")
    llama2c = _llama2c_file(path)
    if llama2c is not None:
        file_config, state = read_llama2c(llama2c)
        if config is not None:
            wrong = [k for k in _LLAMA2C_FIELDS if k in config and config[k] != file_config[k]]
            if wrong:
                raise WeightError(f"{llama2c} does not match model_config: " + ", ".join(
                    f"{k} is {file_config[k]} in the file, {config[k]} in the config" for k in wrong))
            dtype = config.get("torch_dtype") or config.get("dtype")
            file_config = {**file_config, **({"torch_dtype": dtype} if dtype else {})}
        return file_config, DictSource(state)
    if not os.path.isdir(path):
        raise WeightError(f"{path} is neither a model directory nor a llama2.c .bin file")
    if config is None:
        config_file = os.path.join(path, "config.json")
        if not os.path.exists(config_file):
            raise WeightError(f"{path} has no config.json")
        with open(config_file) as f:
            config = json.load(f)
    if os.path.exists(os.path.join(path, "model.pt")):
        return config, TorchFileSource(os.path.join(path, "model.pt"))
    if any(f.endswith(".safetensors") for f in os.listdir(path)):
        return config, SafetensorsSource(path)
    raise WeightError(f"no weights in {path}: expected *.safetensors, model.pt or a llama2.c .bin")


def _llama2c_file(path: str) -> str | None:
    """The llama2.c checkpoint `path` is or holds (a directory with safetensors or model.pt is never one)."""
    if os.path.isfile(path):
        return path if path.endswith(".bin") else None
    files = os.listdir(path)
    if any(f.endswith(".safetensors") or f == "model.pt" for f in files):
        return None
    models = [os.path.join(path, f) for f in sorted(files) if f.endswith(".bin")]
    models = [file for file in models if _is_llama2c(file)]
    if len(models) > 1:
        raise WeightError(f"{path} holds several llama2.c checkpoints ({', '.join(models)}); pass one file")
    return models[0] if models else None


def _is_llama2c(path: str) -> bool:
    """True when the file size is exactly what its 7-int llama2.c header promises (tokenizer .bin files are not)."""
    with open(path, "rb") as f:
        header = f.read(28)
    if len(header) < 28:
        return False
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", header)
    if min(dim, hidden, layers, heads, kv_heads, seq_len) <= 0 or dim % heads:
        return False
    head = dim // heads
    floats = (abs(vocab) * dim + layers * (2 * dim + 2 * dim * dim + 2 * kv_heads * head * dim + 3 * dim * hidden)
              + dim + seq_len * head + (abs(vocab) * dim if vocab < 0 else 0))
    return os.path.getsize(path) == 28 + 4 * floats


def dummy_params(cfg: ModelConfig, seed: int = 0, shardings: dict | None = None) -> dict:
    """`--load-format dummy`: random weights with the real shapes, made on the devices; with `shardings` (a pytree
    like param_shapes) each device draws only its own shards (no full copy of the weights on any device)."""
    return random_params(cfg, seed, shardings=shardings)


def _zeros(shape: tuple, dtype) -> jax.Array:
    return jnp.zeros(shape, dtype)


def _ones(shape: tuple, dtype) -> jax.Array:
    return jnp.ones(shape, dtype)


def _eye(shape: tuple, dtype) -> jax.Array:
    return jnp.eye(*shape, dtype=dtype)


def _refilled(leaf: jax.Array, fill: Callable[[tuple, object], jax.Array]) -> jax.Array:
    """fill(shape, dtype) in `leaf`'s place, made in its shards once its buffers are freed (memory stays flat)."""
    shape, dtype, sharding = leaf.shape, leaf.dtype, leaf.sharding
    leaf.delete()
    return jax.jit(fill, static_argnums=(0, 1), out_shardings=sharding)(shape, dtype)


def echo_params(cfg: ModelConfig, params: dict) -> dict:
    """`--load-format dummy_echo` (module docstring) from `params` (the dummy weights), each new leaf made in the
    shards of the one it replaces. Consumes `params`: the replaced leaves are deleted.

    - Every residual writer (decoder.RESIDUAL_WRITERS) of every layer, the head's included, is zero: each layer adds
      exact zeros, so the main model's logits at a token are lm_head(final_norm(embed(token))).
    - The head: `fc` is [I; 0] ([2H, H], embedding rows first), so it passes pre_fc_norm_embedding(embed(token))
      through and drops the hidden state; its layer adds zeros; pre_fc_norm_embedding scales by 1 and its final norm
      has the main final norm's weight. RMSNorm with scale 1 is idempotent (up to eps and rounding), so its logits
      lm_head(final_norm(norm(embed(token)))) are the main model's for the token it is fed: it drafts what the
      verifier will emit."""
    echoed = jax.tree_util.tree_map_with_path(
        lambda path, leaf: _refilled(leaf, _zeros) if str(path[-1].key) in RESIDUAL_WRITERS else leaf, params)
    if cfg.has_mtp:
        head = echoed["mtp"]
        unit_scale = _zeros if cfg.norm_plus_one else _ones  # the norm's weight w scales by 1 + w or by w
        final_norm_sharding = head["final_norm"].sharding
        head["final_norm"].delete()
        echoed["mtp"] = {**head, "fc": _refilled(head["fc"], _eye),
                         "pre_fc_norm_embedding": _refilled(head["pre_fc_norm_embedding"], unit_scale),
                         "final_norm": jax.device_put(echoed["final_norm"], final_norm_sharding, may_alias=False)}
    return echoed
