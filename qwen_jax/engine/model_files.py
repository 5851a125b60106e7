"""A model directory as the engine and its front read it, without touching a device: the path (or the built-in
default model), its config in the served dtype, the context length, the tokenizer and the EOS ids.

Host files only; the front process uses it to validate and tokenize, the engine core to build the model.
"""

from __future__ import annotations

import json
import os

from qwen_jax.config import ModelConfig, from_hf_dict
from qwen_jax.weights import open_checkpoint


class ModelNotFound(FileNotFoundError):
    """A model (or tokenizer) name that is neither a local path nor in the local Hugging Face cache."""


def resolve_model(model: str | None) -> str:
    """A model directory (or llama2.c .bin), or a Hugging Face hub id found in the local HF cache; None means the small
    built-in default model."""
    if model is None:
        from qwen_jax.default_model import ensure_default_model

        return ensure_default_model()
    return resolve_path(model)


def resolve_path(name: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """A local path as it is, or the directory of a hub id ("Qwen/Qwen3.5-4B") at `revision` (default: main) in the
    local Hugging Face cache (`cache_dir`, default $HF_HOME's): nothing is ever downloaded. Raises ModelNotFound (one
    line) when neither holds."""
    if os.path.exists(name):
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except HFValidationError:
        raise ModelNotFound(f"{name!r} is neither a local path nor a Hugging Face hub id") from None
    except LocalEntryNotFoundError:
        at = f" at revision {revision}" if revision else ""
        raise ModelNotFound(f"{name!r}{at} is not a local path and not in the Hugging Face cache "
                            f"({cache_dir or constants.HF_HUB_CACHE}); this server never downloads: fetch it first "
                            f"(hf download {name}) or give its directory") from None


def _read_config(model_path: str) -> dict:
    path = os.path.join(model_path, "config.json") if os.path.isdir(model_path) else model_path
    if not os.path.exists(path):
        raise ModelNotFound(f"{model_path} has no config.json: a model directory holds a Hugging Face config.json "
                            f"(and its *.safetensors, unless --load-format dummy)")
    with open(path) as f:
        return json.load(f)


def read_model_config(model_path: str, dtype: str = "auto", overrides: dict | None = None) -> ModelConfig:
    """The config the engine serves: a model directory's config.json (or a llama2.c header), in `dtype`, with
    `overrides` (vLLM's --hf-overrides) put over the decoder's entries (`text_config`'s in a multimodal wrapper)."""
    config_dict = _read_config(model_path) if os.path.isdir(model_path) else open_checkpoint(model_path)[0]
    if overrides:
        if not isinstance(overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config.json entries, got {overrides!r}")
        config_dict = dict(config_dict)
        if isinstance(config_dict.get("text_config"), dict):
            config_dict["text_config"] = {**config_dict["text_config"], **overrides}
        else:
            config_dict.update(overrides)
    try:
        cfg = from_hf_dict(config_dict)
    except (KeyError, TypeError, ValueError) as exc:
        if not overrides:
            raise
        raise ValueError(f"hf_overrides {overrides} make an invalid config: {type(exc).__name__}: {exc}") from None
    return cfg if dtype == "auto" else cfg.with_dtype(dtype)


def resolve_max_model_len(cfg: ModelConfig, max_model_len: int | None) -> int:
    """The engine argument, or the model's max_position_embeddings capped at 8192."""
    return int(max_model_len or min(cfg.max_position_embeddings, 8192))


def load_tokenizer(model_path: str):
    """The HF tokenizer of a model directory, or None when it ships none (then only token ids are served)."""
    if os.path.isdir(model_path) and any(os.path.exists(os.path.join(model_path, f))
                                         for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    return None


# generation_config.json's sampling entries -> the SamplingParams fields they set by default
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_path: str, generation_config: str = "auto", overrides: dict | None = None) -> dict:
    """The SamplingParams fields a request that does not set them takes (vLLM's --generation-config): from the
    model's generation_config.json ("auto"), none ("vllm"), or from a directory's; `overrides` (generation-config
    entries) go over them. max_tokens (max_new_tokens) caps every request's."""
    if overrides is not None and (not isinstance(overrides, dict) or set(overrides) - set(GENERATION_DEFAULTS)):
        raise ValueError(f"override_generation_config must be a dict of {', '.join(GENERATION_DEFAULTS)}; got "
                         f"{overrides!r}")
    entries: dict = {}
    if generation_config != "vllm":
        folder = model_path if generation_config == "auto" else generation_config
        path = os.path.join(folder, "generation_config.json")
        if generation_config != "auto" and not os.path.exists(path):
            raise ValueError(f"generation_config {generation_config!r}: no generation_config.json there (give a "
                             f"directory holding one, 'auto' or 'vllm')")
        if os.path.exists(path):
            with open(path) as f:
                entries = {k: v for k, v in json.load(f).items() if k in GENERATION_DEFAULTS and v is not None}
    entries.update(overrides or {})
    return {GENERATION_DEFAULTS[k]: v for k, v in entries.items()}


def tokenizer_json(tokenizer_path: str) -> str | None:
    """The tokenizer's vocabulary as HF tokenizers' JSON (structured outputs read it): its tokenizer.json, else its
    fast tokenizer serialized (transformers converts a SentencePiece one); None when it has neither."""
    path = os.path.join(tokenizer_path, "tokenizer.json")
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    tokenizer = load_tokenizer(tokenizer_path)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None else backend.to_str()


def tokenizer_eos_id(tokenizer_path: str) -> int | None:
    """The tokenizer's end-of-sequence id as its JSON files give it (tokenizer_config.json's eos_token, found among
    its added tokens or tokenizer.json's), without loading the tokenizer (transformers and the torch it imports take
    seconds); None when they do not say."""
    try:
        with open(os.path.join(tokenizer_path, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    for token_id, added in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(added, dict) and added.get("content") == eos:
            return int(token_id)
    try:
        with open(os.path.join(tokenizer_path, "tokenizer.json")) as f:
            tokenizer = json.load(f)
    except (OSError, ValueError):
        return None
    for added in tokenizer.get("added_tokens") or ():
        if added.get("content") == eos:
            return int(added["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    return vocab.get(eos) if isinstance(vocab, dict) else None


def eos_ids(model_path: str, cfg: ModelConfig, tokenizer_path: str) -> list[int]:
    """The ids that end a sequence: the config's, generation_config.json's and the tokenizer's (its JSON files, else
    the tokenizer itself, loaded)."""
    ids = set(cfg.eos_token_ids)
    gen = os.path.join(model_path, "generation_config.json") if os.path.isdir(model_path) else ""
    if gen and os.path.exists(gen):
        with open(gen) as f:
            value = json.load(f).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else (value or []))
    token_id = tokenizer_eos_id(tokenizer_path) if os.path.isdir(tokenizer_path) else None
    if token_id is None:
        tokenizer = load_tokenizer(tokenizer_path)
        token_id = None if tokenizer is None else tokenizer.eos_token_id
    if token_id is not None:
        ids.add(token_id)
    return sorted(ids)
