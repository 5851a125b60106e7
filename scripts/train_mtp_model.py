"""Train a small Qwen3.5-MoE-architecture model together with its MTP head on GSM8K and save it as an HF checkpoint
(`mtp.*` included), or (`--eval`) measure on held-out prompts how often a saved head's draft a greedy verifier accepts.

It must never write weights into the repository (the output directory is an argument) and never trains on the test
split: random weights accept no drafts, so acceptance is measured on this model, and held-out text must stay held out.

Why torch and transformers (not JAX + optax): `Qwen3_5MoeForCausalLM` gives the main model's exact modules and
checkpoint names for free (HF-layout `model.*` / `lm_head.*` tensors with fused `experts.gate_up_proj`), and its
`Qwen3_5MoeDecoderLayer` is the MTP head's one full-attention decoder layer, so `mtp.layers.0.*` carries the same names
as a main layer. Only the head's wrapper (two norms and `fc`) is written here.

How the head is fed, as vLLM's qwen3_next_mtp.py runs it at inference and as it is trained here: the head at position i
takes the main model's hidden state at i after the final norm (what the LM head reads) and the embedding of token
i+1 (the shared `embed_tokens`), normalizes each (`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), concatenates
[embedding, hidden] (embedding first), projects 2H -> H with `fc`, runs `mtp.layers.0` causally over the positions
of the sequence with the rotary position i, applies `mtp.norm` and the shared `lm_head`, and predicts token i+2.
Loss = main LM loss + `--mtp-weight` x the head's loss + the router's load-balancing loss (its config coefficient).

Data: GSM8K train split, each example rendered the way a chat request is served: the chat template's generation
prompt for the question as the user turn with thinking off (`...<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`),
then the answer's tokens and `<|im_end|>`; padded batches of similar lengths; the loss covers every real token.
Held-out = the test split: every `--eval-every` steps the script prints both heads' top-1 accuracy on the answer
tokens of `--heldout` test examples.

Recipe (one H100 or H200; the tokenizer and GSM8K dirs default to ../shared/data):
    python scripts/train_mtp_model.py --out /tmp/qwen35moe-gsm8k-mtp
    python scripts/train_mtp_model.py --eval /tmp/qwen35moe-gsm8k-mtp --eval-prompts 64 --max-new-tokens 256
Defaults: hidden 512, 8 layers (GDN x3 + attention, twice), 32 experts top-4 (intermediate 256) and a shared expert
(512), the real 248,320-row vocabulary with untied embedding and LM head (as the real config; 387M parameters, 254M
of them those two), bf16 autocast over float32 weights, AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1), 20 steps
of linear warm-up then cosine decay to 10%, gradient clipping at 1.0, 800 steps of 32 sequences (3.4 epochs).
`--train-seconds S` sizes the run to about S seconds from its pace instead. `--tiny` (hidden 32, 2 layers, 4 experts)
runs on a CPU, a few seconds a step.

Measured on one H200 (transformers 5.17, torch 2.11, HF's torch fallbacks for the GDN: no flash-linear-attention
there): 0.42 s a step, so the default run trains in about 6 minutes. A 118-step run (53 s) reached, on the answer
tokens of 128 test examples, top-1 0.54 for the main model and 0.42 for the head; `--eval` on 8 prompts x 96
tokens then gave k = 1 acceptance 0.81 (328 of 407 drafts). The default 800-step run has not been measured yet.

The checkpoint directory: config.json (`Qwen3_5MoeForCausalLM`, model_type qwen3_5_moe_text, mtp_num_hidden_layers 1,
torch_dtype bfloat16), model.safetensors (bf16; the main model's tensors as `save_pretrained` names them plus
`mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`, `mtp.layers.0.*`,
`mtp.norm.weight`), generation_config.json, the tokenizer's files and train_report.json. HF's
`Qwen3_5MoeForCausalLM.from_pretrained` loads the main model from it and ignores `mtp.*`.

`--eval` greedy-decodes held-out prompts with the main model alone (HF generate), then runs the main model and the
head once over each prompt + output and counts, for every generated token after the first, whether the head's
top-1 draft (from the hidden state and token before it) equals it: the acceptance an exact greedy verifier with
k = 1 would see, overall and per output position, to cross-check the engine's acceptance statistics.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer, GenerationConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeRMSNorm,
    load_balancing_loss_func,
)

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja")
VOCAB_SIZE = 248320  # the real config's embedding rows (the tokenizer's 248,077 ids, padded)
END_ID, PAD_ID = 248046, 248044  # <|im_end|> (a chat turn's end), <|endoftext|> (pad; the base model's EOS)
STOP_IDS = (END_ID, PAD_ID)
IGNORE = -100
# With --train-seconds, steps [TIMING_START, TIMING_END) are timed to size the run; the first ones are slower (CUDA
# start-up: on an H200 step 0 took 3.8 s, later steps 0.42 s).
TIMING_START, TIMING_END = 3, 13

# name: (hidden, layers, full_attention_interval, heads, kv_heads, head_dim, linear key heads, linear value heads,
#        linear head dim, experts, top-k, expert intermediate, shared expert intermediate)
SIZES = {
    "default": (512, 8, 4, 8, 2, 128, 4, 8, 64, 32, 4, 256, 512),
    "tiny": (32, 2, 2, 2, 1, 16, 2, 4, 8, 4, 2, 16, 16),
}


def model_config(size: str) -> Qwen3_5MoeTextConfig:
    """A Qwen3.5-MoE text config of the given size: the real model's layer pattern (GDN layers, every
    `interval`-th layer full attention), its rope (theta 1e7, a quarter of the head rotated), untied embeddings."""
    (hidden, layers, interval, heads, kv_heads, head_dim, lk_heads, lv_heads, l_dim, experts, top_k, inter,
     shared) = SIZES[size]
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers, layer_types=layer_types,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=lk_heads, linear_num_value_heads=lv_heads, linear_key_head_dim=l_dim,
        linear_value_head_dim=l_dim, linear_conv_kernel_dim=4, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=inter, shared_expert_intermediate_size=shared, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, eos_token_id=PAD_ID, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
        architectures=["Qwen3_5MoeForCausalLM"], attn_implementation="sdpa",
    )


class MtpHead(nn.Module):
    """Qwen3.5's multi-token-prediction head; its parameter names are the checkpoint's `mtp.*` names without the
    prefix. The embedding, rotary table and LM head are the main model's (passed in, never copied)."""

    def __init__(self, config: Qwen3_5MoeTextConfig):
        super().__init__()
        hidden = config.hidden_size
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"]
        layer_config.num_hidden_layers = 1
        layer_config._attn_implementation = "sdpa"  # a None mask is then causal (is_causal), at any length
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(layer_config, 0)])
        self.norm = Qwen3_5MoeRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, model: Qwen3_5MoeForCausalLM, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, V] predicting token i+2 from `hidden` [B, L, H] (the main model's final-normed hidden state
        at position i) and `next_ids` [B, L] (token i+1); positions 0..L-1."""
        embeds = model.model.embed_tokens(next_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device).expand(3, x.shape[0], -1)  # text: t = h = w
        rotary = model.model.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, position_embeddings=rotary, attention_mask=None)
        return model.lm_head(self.norm(x))


def init_head(head: MtpHead, model: Qwen3_5MoeForCausalLM) -> None:
    """The main model's initialization (normal(0, initializer_range), norms zero for their (1 + w) scale)."""
    for module in head.modules():
        model._init_weights(module)


# ---- data ----------------------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The served prompt: the question as the user turn, the generation prompt with thinking off."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                         add_generation_prompt=True, enable_thinking=False, return_dict=False)


def encode_example(tokenizer, example: dict, max_len: int) -> tuple[list[int], int]:
    """(prompt + answer + <|im_end|> token ids, prompt length), cut to `max_len`."""
    prompt = prompt_ids(tokenizer, example["question"])
    ids = prompt + tokenizer.encode(example["answer"], add_special_tokens=False) + [END_ID]
    return ids[:max_len], len(prompt)


def batches(examples: list[tuple[list[int], int]], batch_size: int, rng: random.Random) -> Iterator[list]:
    """Endless shuffled batches of similar lengths: each pool of 32 batches is sorted by length, then split."""
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        pool = 32 * batch_size
        chunks = []
        for start in range(0, len(order), pool):
            ranked = sorted(order[start:start + pool], key=lambda i: len(examples[i][0]))
            chunks += [ranked[i:i + batch_size] for i in range(0, len(ranked), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield [examples[i] for i in chunk]


def collate(batch: list[tuple[list[int], int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(ids [B, L] right-padded, real [B, L] bool, answer [B, L] bool: the token is part of the answer)."""
    length = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), length), PAD_ID, dtype=torch.long)
    real = torch.zeros((len(batch), length), dtype=torch.bool)
    answer = torch.zeros_like(real)
    for row, (tokens, prompt_len) in enumerate(batch):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        real[row, :len(tokens)] = True
        answer[row, prompt_len:len(tokens)] = True
    return ids.to(device), real.to(device), answer.to(device)


# ---- training ------------------------------------------------------------------------------------------------------

def losses(model: Qwen3_5MoeForCausalLM, head: MtpHead, ids: torch.Tensor, real: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(main loss, head loss, router aux loss, main logits [B, L-1, V] for token i+1, head logits [B, L-2, V] for
    token i+2). Right padding never reaches a real token (every layer is causal); the losses skip it."""
    out = model.model(input_ids=ids, output_router_logits=True)
    hidden = out.last_hidden_state  # [B, L, H], after the final norm
    main_logits = model.lm_head(hidden[:, :-1])
    head_logits = head(model, hidden[:, :-2], ids[:, 1:-1])
    main_targets = ids[:, 1:].masked_fill(~real[:, 1:], IGNORE)
    head_targets = ids[:, 2:].masked_fill(~real[:, 2:], IGNORE)
    main_loss = F.cross_entropy(main_logits.float().flatten(0, 1), main_targets.flatten(), ignore_index=IGNORE)
    head_loss = F.cross_entropy(head_logits.float().flatten(0, 1), head_targets.flatten(), ignore_index=IGNORE)
    aux = load_balancing_loss_func(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok,
                                   real.long())
    return main_loss, head_loss, aux, main_logits, head_logits


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_accuracy(model: Qwen3_5MoeForCausalLM, head: MtpHead, heldout: list, batch_size: int, device: torch.device,
                     autocast: bool) -> dict:
    """Top-1 accuracy of the main model (token i+1) and the head (token i+2) on the answer tokens of `heldout`, and
    both losses per token over all of its tokens."""
    model.eval()
    head.eval()
    hits = {"main": 0, "mtp": 0}
    counts = {"main": 0, "mtp": 0}
    loss_sum = {"main": 0.0, "mtp": 0.0}
    loss_tokens = {"main": 0, "mtp": 0}
    for start in range(0, len(heldout), batch_size):
        ids, real, answer = collate(heldout[start:start + batch_size], device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            main_loss, head_loss, _, main_logits, head_logits = losses(model, head, ids, real)
        for name, logits, shift, loss in (("main", main_logits, 1, main_loss), ("mtp", head_logits, 2, head_loss)):
            scored = answer[:, shift:]
            hits[name] += int(((logits.argmax(-1) == ids[:, shift:]) & scored).sum())
            counts[name] += int(scored.sum())
            loss_sum[name] += float(loss) * int(real[:, shift:].sum())
            loss_tokens[name] += int(real[:, shift:].sum())
    model.train()
    head.train()
    return {**{f"{name}_top1": hits[name] / max(1, counts[name]) for name in hits},
            **{f"{name}_loss": loss_sum[name] / max(1, loss_tokens[name]) for name in hits}}


def train(args: argparse.Namespace) -> tuple[Qwen3_5MoeForCausalLM, MtpHead, dict]:
    """Train the model and its head; returns both (float32 weights) and the report (loss curve, held-out accuracy)."""
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = device.type == "cuda"  # bf16 autocast on the GPU; float32 on the CPU (tiny runs)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) != list(STOP_IDS):
        raise ValueError(f"{args.tokenizer} is not the Qwen3.5 tokenizer: <|im_end|> and <|endoftext|> must be "
                         f"ids {STOP_IDS}")
    data = Path(args.gsm8k)
    train_rows = read_jsonl(data / "train.jsonl")[:args.train_examples or None]
    train_set = [encode_example(tokenizer, row, args.max_len) for row in train_rows]
    heldout = [encode_example(tokenizer, row, args.max_len) for row in read_jsonl(data / "test.jsonl")
               [:args.heldout]]

    config = model_config("tiny" if args.tiny else "default")
    model = Qwen3_5MoeForCausalLM(config).to(device)
    head = MtpHead(config).to(device)
    init_head(head, model)
    params = [p for m in (model, head) for p in m.parameters()]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                  fused=device.type == "cuda")
    steps = args.steps
    report = {"config": {"size": "tiny" if args.tiny else "default", "steps": steps,
                         "batch_size": args.batch_size, "lr": args.lr, "mtp_weight": args.mtp_weight,
                         "train_examples": len(train_set), "heldout_examples": len(heldout),
                         "params": sum(p.numel() for p in params), "device": str(device)},
              "curve": [], "heldout": []}
    print(json.dumps(report["config"]), flush=True)
    stream = batches(train_set, args.batch_size, rng)
    started = time.time()
    step = 0
    while step < steps:
        if step == TIMING_START:
            timing_started = time.time()
        if args.train_seconds and step == TIMING_END:
            pace = (time.time() - timing_started) / (TIMING_END - TIMING_START)
            steps = max(TIMING_END + 1, int(TIMING_END + (args.train_seconds - (time.time() - started)) / pace))
            report["config"]["steps"] = steps
            print(json.dumps({"steps": steps, "seconds_per_step": round(pace, 3)}), flush=True)
        warmup = max(1, min(20, steps // 10))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, warmup)
        ids, real, _ = collate(next(stream), device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            main_loss, head_loss, aux, _, _ = losses(model, head, ids, real)
        loss = main_loss + args.mtp_weight * head_loss + config.router_aux_loss_coef * aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        point = {"step": step, "lr": round(optimizer.param_groups[0]["lr"], 6), "loss": float(loss.detach()),
                 "main": float(main_loss.detach()), "mtp": float(head_loss.detach()),
                 "seconds": round(time.time() - started, 1)}
        report["curve"].append(point)
        if step % args.log_every == 0 or step == steps - 1:
            print(json.dumps(point), flush=True)
        if (step + 1) % args.eval_every == 0 or step == steps - 1:
            accuracy = {"step": step, **heldout_accuracy(model, head, heldout, args.batch_size, device, autocast)}
            report["heldout"].append(accuracy)
            print(json.dumps({"heldout": accuracy}), flush=True)
        step += 1
    return model, head, report


# ---- checkpoint ----------------------------------------------------------------------------------------------------

def save_checkpoint(model: Qwen3_5MoeForCausalLM, head: MtpHead, out: Path, tokenizer_dir: Path,
                    report: dict | None = None) -> None:
    """The HF-layout directory: config.json, model.safetensors (bf16, `mtp.*` included), generation_config.json,
    the tokenizer's files (not its config.json: ours names the model)."""
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.update(architectures=["Qwen3_5MoeForCausalLM"], dtype="bfloat16", torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {name: t.detach().to(torch.bfloat16).cpu().contiguous() for name, t in model.state_dict().items()}
    tensors.update({f"mtp.{name}": t.detach().to(torch.bfloat16).cpu().contiguous()
                    for name, t in head.state_dict().items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig(eos_token_id=list(STOP_IDS), pad_token_id=PAD_ID, do_sample=False).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    if report is not None:
        (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")


def load_checkpoint(path: Path, device: torch.device) -> tuple[Qwen3_5MoeForCausalLM, MtpHead]:
    """The main model through HF's `from_pretrained` (which ignores `mtp.*`) and the head from the `mtp.*` tensors,
    both in bf16."""
    model = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    head = MtpHead(model.config)
    tensors = load_file(str(Path(path) / "model.safetensors"))
    head.load_state_dict({name[len("mtp."):]: t for name, t in tensors.items() if name.startswith("mtp.")},
                         strict=True)
    return model.to(device).eval(), head.to(device=device, dtype=torch.bfloat16).eval()


# ---- acceptance ----------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate_acceptance(args: argparse.Namespace) -> dict:
    """Greedy-decode held-out prompts with the main model; per output position, how often the head's top-1 draft
    equals the main model's next token (k = 1 exact greedy acceptance)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, head = load_checkpoint(Path(args.eval), device)
    tokenizer = AutoTokenizer.from_pretrained(args.eval)
    rows = read_jsonl(Path(args.gsm8k) / "test.jsonl")[:args.eval_prompts]
    accepted_at = [0] * args.max_new_tokens
    drafted_at = [0] * args.max_new_tokens
    per_prompt = []
    for row in rows:
        prompt = torch.tensor([prompt_ids(tokenizer, row["question"])], device=device)
        generated = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False,
                                   eos_token_id=list(STOP_IDS), pad_token_id=PAD_ID)[0, prompt.shape[1]:].tolist()
        if any(t in STOP_IDS for t in generated):
            generated = generated[:next(i for i, t in enumerate(generated) if t in STOP_IDS) + 1]
        sequence = torch.cat([prompt[0], torch.tensor(generated, device=device)])[None]
        hidden = model.model(input_ids=sequence).last_hidden_state
        drafts = head(model, hidden[:, :-1], sequence[:, 1:]).argmax(-1)[0]  # drafts[i]: token i+2
        start = prompt.shape[1] - 1  # the draft made with the first output token predicts the second
        hits = [int(drafts[start + j] == generated[j + 1]) for j in range(len(generated) - 1)]
        for j, hit in enumerate(hits):
            drafted_at[j] += 1
            accepted_at[j] += hit
        per_prompt.append({"output_tokens": len(generated), "drafted": len(hits), "accepted": sum(hits)})
    drafted, accepted = sum(drafted_at), sum(accepted_at)
    rate = accepted / max(1, drafted)
    report = {"checkpoint": str(args.eval), "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
              "drafted": drafted, "accepted": accepted, "acceptance_rate_k1": rate,
              "acceptance_length_k1": 1 + rate,
              "per_position": [{"position": j, "drafted": d, "accepted": a}
                               for j, (d, a) in enumerate(zip(drafted_at, accepted_at)) if d],
              "per_prompt": per_prompt}
    print(json.dumps({k: v for k, v in report.items() if k not in ("per_position", "per_prompt")}), flush=True)
    return report


# ---- command line --------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="checkpoint directory to write (training)")
    parser.add_argument("--eval", help="checkpoint directory to measure greedy k=1 acceptance on")
    parser.add_argument("--tokenizer", default=str(SHARED_DATA / "qwen3_5_tokenizer"))
    parser.add_argument("--gsm8k", default=str(SHARED_DATA / "gsm8k"), help="dir with train.jsonl and test.jsonl")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, for a CPU test")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--train-seconds", type=float, default=0,
                        help="size the run to about this long from its first steps' pace (overrides --steps)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--mtp-weight", type=float, default=0.5, help="weight of the MTP head's loss")
    parser.add_argument("--max-len", type=int, default=512, help="tokens per example, prompt included")
    parser.add_argument("--train-examples", type=int, default=0, help="use the first N train examples (0: all)")
    parser.add_argument("--heldout", type=int, default=128, help="test examples scored every --eval-every steps")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-prompts", type=int, default=64, help="--eval: held-out prompts to decode")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="--eval: tokens to decode per prompt")
    args = parser.parse_args(argv)
    if bool(args.out) == bool(args.eval):
        parser.error("give exactly one of --out (train) and --eval (measure acceptance)")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Train and save (--out) or measure acceptance (--eval); returns the report."""
    args = parse_args(argv)
    if args.eval:
        return evaluate_acceptance(args)
    model, head, report = train(args)
    save_checkpoint(model, head, Path(args.out), Path(args.tokenizer), report)
    print(f"saved {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
