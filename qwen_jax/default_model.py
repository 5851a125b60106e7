"""The built-in default model: a tiny random-weight Qwen3.5-MoE HF directory (config, safetensors, BPE tokenizer).

Built once per cache directory, deterministically and atomically; never downloads anything, never a trained model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

VERSION = "default-model-v1"
SEED = 1234

# Qwen3.5's pre-tokenizer split (the `\p{M}` classes are what differ from Qwen2/Qwen3).
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"
                     r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (content, special): the Qwen specials this package relies on. <think> and </think> are plain added tokens in
# Qwen3.5 (they decode into the text), so they are here too.
ADDED_TOKENS = (("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                ("<think>", False), ("</think>", False))
BPE_VOCAB_SIZE = 512  # byte alphabet (256) + merges; the added tokens come on top

TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "dtype": "bfloat16",
    "full_attention_interval": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 16,
    "max_position_embeddings": 4096,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 32,
    "tie_word_embeddings": False,
    "use_cache": True,
    "mamba_ssm_dtype": "float32",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [1, 1, 0]},
}

# Qwen's ChatML with the Qwen3.5 thinking switch: the generation prompt opens a think block, or (thinking off)
# closes an empty one. Content may be a string or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}"
    "{%- if part is mapping and 'text' in part -%}{{- part['text'] -}}"
    "{%- else -%}{{- raise_exception('Only text content parts are supported.') -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- elif content is none or content is undefined -%}"
    "{%- else -%}{{- raise_exception('Unexpected content type.') -}}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if not messages -%}{{- raise_exception('No messages provided.') -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ('system', 'user', 'assistant', 'tool') -%}"
    "{{- raise_exception('Unexpected message role.') -}}{%- endif -%}"
    "{%- if message['role'] == 'system' and not loop.first -%}"
    "{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}"
    "{%- set content = text(message['content']) | trim -%}"
    "{%- if message['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] | trim -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model speaks in random tokens, and that is fine.
Hello! How are you today? I am a language model served by qwen-jax, a JAX inference engine.
Question: What is 12 plus 30? Answer: 12 + 30 = 42. The answer is 42.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n
User: Tell me a story about a robot who learns to paint.
Assistant: Once upon a time, a small robot found a brush and a jar of blue paint in an old garden.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? , . ; : ' " ` @ # $
Über café naïve résumé — fiancée, jalapeño, Straße, 東京, 你好世界, こんにちは, 안녕하세요, Привет, مرحبا.
Streaming responses arrive one token at a time; the server sends them as server-sent events.
The weather is sunny, the sky is clear, and the river flows quietly past the mill.
"""


def default_cache_dir() -> str:
    base = os.environ.get("QWEN_JAX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qwen_jax")
    return base


def ensure_default_model(cache_dir: str | None = None) -> str:
    """Path of the default model directory, building it on first use (safe against concurrent builders)."""
    root = cache_dir or default_cache_dir()
    target = os.path.join(root, VERSION)
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{VERSION}-", dir=root)
    try:
        build_default_model(staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first: keep theirs
            if not os.path.exists(os.path.join(target, "model.safetensors")):
                raise
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return target


def build_default_model(directory: str) -> None:
    """Write the whole checkpoint into an existing (empty) directory."""
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {content: tokenizer.token_to_id(content) for content, _ in ADDED_TOKENS}
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text_config = dict(TEXT_CONFIG, vocab_size=vocab, eos_token_id=ids["<|endoftext|>"])
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_config,
        "tie_word_embeddings": False,
        "transformers_version": "5.0.0",
    }
    _write_json(os.path.join(directory, "config.json"), config)
    _write_json(os.path.join(directory, "generation_config.json"), {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
    })
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    _write_json(os.path.join(directory, "tokenizer_config.json"), {
        "tokenizer_class": "TokenizersBackend",
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": TEXT_CONFIG["max_position_embeddings"],
        "added_tokens_decoder": {
            str(ids[content]): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": special}
            for content, special in ADDED_TOKENS
        },
    })
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    _write_safetensors(os.path.join(directory, "model.safetensors"), hf_tensors(text_config, SEED))
    with open(os.path.join(directory, "README.md"), "w") as f:
        f.write("# qwen-jax default model\n\nA tiny Qwen3.5-MoE with random weights (seed "
                f"{SEED}) and a {vocab}-token byte-level BPE, built by `qwen_jax.default_model`. "
                "It exists to exercise the engine and the server end to end; its text is gibberish.\n")


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on a short inline corpus, with Qwen3.5's normalizer, split and specials."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) * 4, trainer=trainer)
    tok.add_tokens([AddedToken(c, special=s, normalized=False) for c, s in ADDED_TOKENS if not s])
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c, s in ADDED_TOKENS if s])
    # Keep the ids in Qwen's order (<|endoftext|>, <|im_start|>, <|im_end|>, <think>, </think>).
    ordered = Tokenizer.from_str(tok.to_str())
    data = json.loads(ordered.to_str())
    base = len(data["model"]["vocab"])
    for i, added in enumerate(sorted(data["added_tokens"], key=lambda t: [c for c, _ in ADDED_TOKENS]
                                     .index(t["content"]))):
        added["id"] = base + i
    data["added_tokens"].sort(key=lambda t: t["id"])
    return Tokenizer.from_str(json.dumps(data))


def hf_tensors(text: dict, seed: int) -> dict[str, np.ndarray]:
    """Random tensors with the HF Qwen3.5-MoE names and shapes (fused experts), in the checkpoint's layout."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    h, v = text["hidden_size"], text["vocab_size"]
    n, kv, d = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv, kern = text["linear_key_head_dim"], text["linear_value_head_dim"], text["linear_conv_kernel_dim"]
    e, inter, shared = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]

    def normal(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(bf16)

    def zeros(*shape: int) -> np.ndarray:  # Qwen3.5 norms scale by (1 + w)
        return np.zeros(shape, bf16)

    pre = "model.language_model."
    out = {pre + "embed_tokens.weight": normal(v, h, scale=1.0), pre + "norm.weight": zeros(h),
           "lm_head.weight": normal(v, h, scale=0.5)}
    for i, kind in enumerate(text["layer_types"]):
        p = f"{pre}layers.{i}."
        out[p + "input_layernorm.weight"] = zeros(h)
        out[p + "post_attention_layernorm.weight"] = zeros(h)
        if kind == "full_attention":
            a = p + "self_attn."
            out.update({a + "q_proj.weight": normal(n * 2 * d, h, scale=0.2),  # rows: [head][query | gate]
                        a + "k_proj.weight": normal(kv * d, h, scale=0.2),
                        a + "v_proj.weight": normal(kv * d, h, scale=0.2),
                        a + "o_proj.weight": normal(h, n * d, scale=0.2),
                        a + "q_norm.weight": zeros(d), a + "k_norm.weight": zeros(d)})
        else:
            g = p + "linear_attn."
            conv_dim = 2 * nk * dk + nv * dv
            out.update({g + "in_proj_qkv.weight": normal(conv_dim, h, scale=0.2),
                        g + "in_proj_z.weight": normal(nv * dv, h, scale=0.2),
                        g + "in_proj_b.weight": normal(nv, h, scale=0.2),
                        g + "in_proj_a.weight": normal(nv, h, scale=0.2),
                        g + "conv1d.weight": normal(conv_dim, 1, kern, scale=0.3),
                        g + "A_log": np.log(rng.uniform(1.0, 16.0, nv)).astype(np.float32),
                        g + "dt_bias": np.ones(nv, np.float32),
                        g + "norm.weight": np.ones(dv, bf16),
                        g + "out_proj.weight": normal(h, nv * dv, scale=0.2)})
        m = p + "mlp."
        out.update({m + "gate.weight": normal(e, h, scale=0.5),
                    m + "experts.gate_up_proj": normal(e, 2 * inter, h, scale=0.2),
                    m + "experts.down_proj": normal(e, h, inter, scale=0.2),
                    m + "shared_expert.gate_proj.weight": normal(shared, h, scale=0.2),
                    m + "shared_expert.up_proj.weight": normal(shared, h, scale=0.2),
                    m + "shared_expert.down_proj.weight": normal(h, shared, scale=0.2),
                    m + "shared_expert_gate.weight": normal(1, h, scale=0.2)})
    return out


def _write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(t) for k, t in sorted(tensors.items())}, path, metadata={"format": "pt"})


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
