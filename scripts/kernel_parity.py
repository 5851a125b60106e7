"""Kernel parity on random weights: greedy decoding with kernels="gpu" against kernels="reference", both engines in
one process over one set of random weights (`dummy_params`), free-running and teacher-forced, as JSON. The engines
are create_engine's (engine/eval_adapter.py): the served forward program (engine/step.py) over the same flat ragged
batches, with each step's full logits in hand, which the serving engine never hands out.

Random weights give near-uniform logits, so free-running greedy tokens part at near-ties; the teacher-forced run
(the gpu engine fed the reference's tokens) compares the logits of every step instead. With the dummy weights' std
0.02 everywhere the full-size model amplifies rounding into different logits; `--embed-scale 1 --residual-scale
0.002 --dt-bias -4` gives a model that does not (residual_scales, set_leaves; scripts/device_bench_suite.sh runs
that; RESULTS.json's greedy_divergence and moe_parity entries have its numbers). Never keeps full-vocab logits rows
beyond the current step: each step's statistics are computed on the device.

Phases (each prefills every prompt, then runs --steps decode steps; step 0 is the prefill's last-token logits):
  1. reference, free-running greedy (timed: ms per decode step of the batch; each step waits for its token on the
     host before the next is issued, so this is not the server's TPOT): its tokens, top-1 ids and top-1/top-2
     margins;
  2. gpu, free-running greedy (timed): its tokens; the first step where they part from the reference's;
  3. teacher-forced, both engines in lockstep fed phase 1's tokens: per step, top-1 agreement, max |logit diff|,
     relative error, max |log-softmax diff|; the reference's top-1 there is checked against phase 1 (determinism).
     Beside it, controls on the reference: how much its logits move when the prompt's context is replaced or the
     recurrent state wiped, the scale at which a cache or state bug would show (see _controls); and the
     reference against itself with the embeddings nudged by one bf16 ulp: how much the model amplifies rounding.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.config import load_config
from qwen_jax.engine.eval_adapter import Engine
from qwen_jax.models.decoder import RESIDUAL_WRITERS, param_names, random_params
from qwen_jax.weights import dummy_params

WINDOW = 32  # decode steps per relative-error window


@jax.jit
def _top2(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] float32 -> (top-1 ids [B], top-1 minus top-2 logit [B], which is also the logprob margin)."""
    vals, ids = jax.lax.top_k(logits, 2)
    return ids[:, 0], vals[:, 0] - vals[:, 1]


@jax.jit
def _compare(ref: jax.Array, gpu: jax.Array) -> dict:
    """Per-row statistics of the gpu logits [B, V] against the reference's of the same step."""
    ref_top1, ref_margin = _top2(ref)
    gpu_top1, gpu_margin = _top2(gpu)
    rows = jnp.arange(ref.shape[0])
    return {
        "ref_top1": ref_top1, "ref_margin": ref_margin, "gpu_top1": gpu_top1, "gpu_margin": gpu_margin,
        "max_abs_diff": jnp.abs(gpu - ref).max(-1),
        "rel_err": jnp.abs(gpu - ref).max(-1) / jnp.abs(ref).max(-1),
        "lsm_max_abs_diff": jnp.abs(jax.nn.log_softmax(gpu) - jax.nn.log_softmax(ref)).max(-1),
        # how much the reference prefers its own top-1 over the gpu's (0 where they agree)
        "ref_deficit": ref[rows, ref_top1] - ref[rows, gpu_top1],
    }


def residual_scales(cfg, embed_scale: float | None, residual_scale: float | None) -> dict[str, float]:
    """random_params' per-leaf stds for --embed-scale / --residual-scale (those of this model's leaves).

    With every matrix at std 0.02 (the dummy weights) each layer adds more to the residual stream than the embedding
    holds and the full-size model amplifies one bf16 ulp into different logits (RESULTS.json), so the
    comparison cannot tell a kernel bug from rounding. A large embedding (std 1) and small residual writers (e.g.
    0.002) keep each layer's contribution a few percent of the stream: rounding stays rounding, while the context
    and the recurrent state still move the logits (the controls measure by how much)."""
    names = param_names(cfg)
    scales = {} if embed_scale is None else {"embed": embed_scale}
    if residual_scale is not None:
        scales |= {name: residual_scale for name in RESIDUAL_WRITERS if name in names}
    return scales


def set_leaves(params: dict, name: str, value: float) -> dict:
    """Every leaf called `name` filled with `value`. For dt_bias: at the dummy weights' 1 the gates' decay per token,
    exp(-exp(A_log) * softplus(a + dt_bias)), is typically under 1e-3 (A_log draws -exp(A_log) in [-16, -1]), so
    a random model's GDN states forget within a token or two and add little to the logits; at -4 (dt ~0.02, inside
    the 0.001-0.1 that Mamba-style models start dt at) they remember tens of tokens."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.full_like(leaf, value) if str(path[-1].key) == name else leaf, params)


def make_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[np.ndarray]:
    """Deterministic random token ids in [1, vocab) (one generator per prompt)."""
    return [np.random.default_rng([seed, n]).integers(1, vocab_size, size, dtype=np.int32)
            for n, size in enumerate(lengths)]


def _greedy(engine: Engine, tag: str, prompts: list[np.ndarray], steps: int) -> dict:
    """Free-running greedy decoding of all prompts as one batch: tokens, top-1 margins [prompts, steps + 1] and the
    wall time of the prefill and of the decode loop."""
    ids = [(tag, n) for n in range(len(prompts))]
    t0 = time.perf_counter()
    token, margin = (np.asarray(a) for a in _top2(engine.prefill(ids, prompts)))
    prefill_s = time.perf_counter() - t0
    tokens, margins = [token], [margin]
    t0 = time.perf_counter()
    for _ in range(steps):
        token, margin = (np.asarray(a) for a in _top2(engine.decode(ids, tokens[-1])))  # np.asarray waits
        tokens.append(token)
        margins.append(margin)
    decode_s = time.perf_counter() - t0
    engine.remove(ids)
    return {"tokens": np.stack(tokens, 1), "margins": np.stack(margins, 1), "prefill_s": prefill_s,
            "decode_s": decode_s}


def _controls(ref: Engine, prompts: list[np.ndarray], first_tokens: np.ndarray, vocab_size: int, seed: int) -> dict:
    """The scale at which a cache or state bug would show, measured on the reference (the kernels' errors are only
    evidence where they sit far below it; with small random weights they may not):
      context: the prefill logits of each prompt against those of the same prompt with every token but the last
        replaced (what everything before the last token contributes);
      gdn_state_wiped: the first decode step's logits against the same step after the prefill's Gated DeltaNet
        states were zeroed (what the recurrent state contributes; None for models without GDN layers)."""
    variants = [np.concatenate([other[:-1], prompt[-1:]])
                for prompt, other in zip(prompts, make_prompts([p.size for p in prompts], vocab_size, seed + 1))]
    logits = []
    for tag, batch in (("context", prompts), ("variant", variants)):
        ids = [(tag, n) for n in range(len(prompts))]
        logits.append(ref.prefill(ids, batch))
        ref.remove(ids)
    out = {"context": _control_summary(_compare(*logits)), "gdn_state_wiped": None}
    gdn = [i for i, layer in enumerate(ref.cache["layers"]) if "ssm" in layer]
    if gdn:
        logits = []
        for wipe in (False, True):
            ids = [("state", n) for n in range(len(prompts))]
            ref.prefill(ids, prompts)
            if wipe:
                slots = np.array([ref.requests[rid].slot for rid in ids])
                for i in gdn:
                    ref.cache["layers"][i]["ssm"] = ref.cache["layers"][i]["ssm"].at[slots].set(0.0)
            logits.append(ref.decode(ids, first_tokens))
            ref.remove(ids)
        out["gdn_state_wiped"] = _control_summary(_compare(*logits))
    return out


def one_ulp_nudge(table: jax.Array, seed: int) -> jax.Array:
    """Each entry moved by about one unit in the last place of its dtype, up or down at random."""
    sign = jax.random.rademacher(jax.random.key(seed + 2), table.shape, jnp.float32)
    ulp = 2.0 ** -(jnp.finfo(table.dtype).nmant)
    return (table.astype(jnp.float32) * (1.0 + sign * ulp)).astype(table.dtype)


def _nudge_summary(stats: dict[str, np.ndarray]) -> dict:
    agree = stats["ref_top1"] == stats["gpu_top1"]
    return {"steps": int(agree.shape[1]) - 1, "prefill_rel_diff": [float(v) for v in stats["rel_err"][:, 0]],
            "top1_agreement": float(agree.mean()), "median_rel_diff": float(np.median(stats["rel_err"])),
            "median_lsm_diff": float(np.median(stats["lsm_max_abs_diff"]))}


def _control_summary(stats: dict) -> dict:
    stats = jax.device_get(stats)
    return {"rel_diff": [float(v) for v in stats["rel_err"]],
            "lsm_max_abs_diff": [float(v) for v in stats["lsm_max_abs_diff"]],
            "top1_same": [bool(v) for v in stats["ref_top1"] == stats["gpu_top1"]]}


def _teacher_forced(ref: Engine, gpu: Engine, prompts: list[np.ndarray], tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Both engines prefilled with the prompts and fed `tokens` [prompts, steps + 1] (the reference's greedy tokens)
    in lockstep; _compare's statistics per step, each [prompts, steps + 1]."""
    ids = [("teacher", n) for n in range(len(prompts))]
    stats = [jax.device_get(_compare(ref.prefill(ids, prompts), gpu.prefill(ids, prompts)))]
    for step in range(tokens.shape[1] - 1):
        stats.append(jax.device_get(_compare(ref.decode(ids, tokens[:, step]), gpu.decode(ids, tokens[:, step]))))
    ref.remove(ids)
    gpu.remove(ids)
    return {k: np.stack([s[k] for s in stats], 1) for k in stats[0]}


def _sig(values: np.ndarray) -> list:
    """Nested lists of floats with 4 significant digits (small errors stay visible, the JSON stays short)."""
    return np.vectorize(lambda v: float(f"{v:.4g}"), otypes=[object])(values).tolist()


def _first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else None


def _free_running_report(ref: dict, gpu: dict) -> dict:
    first = [_first_difference(a, b) for a, b in zip(ref["tokens"], gpu["tokens"])]
    at = lambda m, n, i: None if i is None else float(f"{m[n, i]:.4g}")
    return {
        "identical": [i is None for i in first],
        "first_divergence_step": first,
        "ref_margin_at_divergence": [at(ref["margins"], n, i) for n, i in enumerate(first)],
        "gpu_margin_at_divergence": [at(gpu["margins"], n, i) for n, i in enumerate(first)],
        "ref_margin_median": [float(f"{np.median(m):.4g}") for m in ref["margins"]],
    }


def _windows(values: np.ndarray) -> list[dict]:
    """Mean and max of values [prompts, steps + 1] over windows of WINDOW decode steps (step 0, the prefill, apart)."""
    out = []
    for lo in range(1, values.shape[1], WINDOW):
        part = values[:, lo:lo + WINDOW]
        out.append({"steps": [lo, lo + part.shape[1] - 1], "mean": float(part.mean()), "max": float(part.max())})
    return out


def _teacher_forced_report(stats: dict[str, np.ndarray], ref_tokens: np.ndarray, ref_margins: np.ndarray) -> dict:
    agree = stats["gpu_top1"] == stats["ref_top1"]
    lsm = stats["lsm_max_abs_diff"]
    max_lsm = float(lsm.max())
    # The kernels' logprob noise: the largest log-softmax difference at steps where the top-1 agrees. A step whose
    # top-1 differs is left out: an error large enough to pick a wrong token must not raise the bar that excuses it.
    noise = float(lsm[agree].max()) if agree.any() else max_lsm
    where = np.argwhere(~agree)
    disagreements = [{"prompt": int(n), "step": int(i), "ref_margin": float(stats["ref_margin"][n, i]),
                      "ref_deficit": float(stats["ref_deficit"][n, i]),
                      "lsm_max_abs_diff": float(lsm[n, i])} for n, i in where]
    windows = _windows(stats["rel_err"])
    confident = stats["ref_margin"] > noise  # steps that are no near-tie at the kernels' noise level
    return {
        "steps_compared": int(agree.size),
        "top1_agreement": float(agree.mean()),
        "disagreements": len(disagreements),
        "lsm_noise": noise,
        # near-tie flips: the reference's top-1/top-2 margin there is below the noise; stricter, the reference's
        # preference for its top-1 over the gpu's pick (ref_deficit >= ref_margin) is below it too
        "disagreements_with_ref_margin_below_noise": sum(d["ref_margin"] < noise for d in disagreements),
        "disagreements_with_ref_deficit_below_noise": sum(d["ref_deficit"] < noise for d in disagreements),
        "disagreements_with_ref_margin_below_max_lsm_diff": sum(d["ref_margin"] < max_lsm for d in disagreements),
        "agreement_where_ref_margin_above_noise": float(agree[confident].mean()) if confident.any() else None,
        "steps_with_ref_margin_above_noise": int(confident.sum()),
        "max_lsm_diff": max_lsm,
        "median_lsm_diff": float(np.median(lsm)),
        "max_abs_logit_diff": float(stats["max_abs_diff"].max()),
        "max_rel_err": float(stats["rel_err"].max()),
        "median_rel_err": float(np.median(stats["rel_err"])),
        "prefill": {k: [float(v) for v in stats[k][:, 0]] for k in ("rel_err", "lsm_max_abs_diff", "ref_margin")}
        | {"top1_agree": [bool(v) for v in agree[:, 0]]},
        "rel_err_first_window": windows[0] if windows else None,
        "rel_err_last_window": windows[-1] if windows else None,
        "rel_err_windows": windows,
        # phase 3's reference fed its own phase-1 tokens must pick them again (a deterministic reference)
        "reference_rerun_top1_matches": bool((stats["ref_top1"] == ref_tokens).all()),
        "reference_rerun_max_margin_diff": float(np.abs(stats["ref_margin"] - ref_margins).max()),
        "disagreement_list": disagreements,
        "per_step": {k: _sig(v) for k, v in stats.items() if k in ("rel_err", "lsm_max_abs_diff", "ref_margin")}
        | {"top1_agree": agree.tolist()},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a directory with config.json (random weights are used)")
    ap.add_argument("--steps", type=int, default=256, help="decode steps after the prefill")
    ap.add_argument("--prompts", type=int, default=2, help="how many prompts (one batch), lengths from --prompt-lens")
    ap.add_argument("--prompt-lens", default="64,200,128,40", help="prompt n has length n-th of these (cycled)")
    ap.add_argument("--dtype", default="auto", help="the model dtype (auto: config.json's)")
    ap.add_argument("--seed", type=int, default=0, help="of the random weights and the prompts")
    ap.add_argument("--init-scale", type=float, default=None,
                    help="std of the random weights (default: the server's --load-format dummy weights, 0.02)")
    ap.add_argument("--embed-scale", type=float, default=None,
                    help="std of the embedding table (default: --init-scale). With --residual-scale: see RESIDUAL")
    ap.add_argument("--residual-scale", type=float, default=None,
                    help="std of the projections that write into the residual stream (default: --init-scale)")
    ap.add_argument("--dt-bias", type=float, default=None,
                    help="every GDN layer's dt_bias (default: the dummy weights' 1, see set_leaves)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    cfg = load_config(args.model)
    cfg = cfg if args.dtype == "auto" else cfg.with_dtype(args.dtype)
    lens = [int(v) for v in args.prompt_lens.split(",")]
    lengths = [lens[n % len(lens)] for n in range(args.prompts)]
    prompts = make_prompts(lengths, cfg.vocab_size, args.seed)
    device = jax.devices()[0]
    t0 = time.perf_counter()
    scales = residual_scales(cfg, args.embed_scale, args.residual_scale)
    params = (dummy_params(cfg, seed=args.seed) if args.init_scale is None and not scales  # shared by both engines
              else random_params(cfg, args.seed, scale=args.init_scale or 0.02, scales=scales))
    if args.dt_bias is not None:
        params = set_leaves(params, "dt_bias", args.dt_bias)
    params = jax.block_until_ready(params)
    params_s = time.perf_counter() - t0
    geometry = dict(max_num_seqs=len(prompts), max_model_len=max(lengths) + args.steps + 1)
    engines = {k: Engine(cfg, params, device, kernels=k, **geometry) for k in ("reference", "gpu")}
    report = {"model": args.model, "dtype": cfg.dtype, "device": str(device), "steps": args.steps,
              "prompt_lens": lengths, "batch": len(prompts), "seed": args.seed, "params_s": round(params_s, 1),
              "init_scale": args.init_scale, "scales": scales, "dt_bias": args.dt_bias}

    def save() -> None:  # after each phase, so a run cut short still leaves what it measured
        with open(args.out, "w") as f:
            json.dump(report, f)

    runs = {}
    for kernels, engine in engines.items():
        t0 = time.perf_counter()
        _greedy(engine, "warmup", prompts, 1)  # compiles the prefill and decode programs
        compile_s = time.perf_counter() - t0
        runs[kernels] = run = _greedy(engine, kernels, prompts, args.steps)
        report[kernels] = {"compile_and_warmup_s": round(compile_s, 1), "prefill_ms": round(run["prefill_s"] * 1e3, 2),
                           "ms_per_decode_step": round(run["decode_s"] * 1e3 / max(args.steps, 1), 3),
                           "tokens": run["tokens"].tolist(),
                           "top2_margins": _sig(run["margins"])}
        print(json.dumps({"phase": kernels, **{k: v for k, v in report[kernels].items()
                                               if k not in ("tokens", "top2_margins")}}), flush=True)
        save()
    report["free_running"] = _free_running_report(runs["reference"], runs["gpu"])
    save()
    report["controls"] = _controls(engines["reference"], prompts, runs["reference"]["tokens"][:, 0], cfg.vocab_size,
                                   args.seed)
    save()
    # Rounding control: the reference against itself with one bf16 ulp added to or taken from every embedding
    # entry (the size of the kernels' own per-op differences), teacher-forced over the first WINDOW steps. Where
    # this already moves the logits as much as the kernels do, the random model amplifies rounding, and the
    # kernels' difference is indistinguishable from it.
    nudged = Engine(cfg, {**params, "embed": one_ulp_nudge(params["embed"], args.seed)}, device,
                    kernels="reference", **geometry)
    report["controls"]["embedding_one_ulp"] = _nudge_summary(
        _teacher_forced(engines["reference"], nudged, prompts, runs["reference"]["tokens"][:, :WINDOW + 1]))
    del nudged
    save()
    stats = _teacher_forced(engines["reference"], engines["gpu"], prompts, runs["reference"]["tokens"])
    report["teacher_forced"] = _teacher_forced_report(stats, runs["reference"]["tokens"], runs["reference"]["margins"])
    save()
    tf = report["teacher_forced"]
    # the kernels' logits error in units of what one bf16 ulp on the embeddings does to the reference's
    one_ulp = max(report["controls"]["embedding_one_ulp"]["median_rel_diff"], 1e-30)
    summary = {"steps": args.steps, "prompt_lens": lengths, "dtype": cfg.dtype,
               "ms_per_decode_step": {k: report[k]["ms_per_decode_step"] for k in engines},
               "control_rel_diff": {k: v and v.get("rel_diff", v.get("prefill_rel_diff"))
                                    for k, v in report["controls"].items()},
               "one_ulp_control": report["controls"]["embedding_one_ulp"],
               "free_running": {k: report["free_running"][k] for k in
                                ("first_divergence_step", "ref_margin_at_divergence", "ref_margin_median")},
               "teacher_forced": {k: tf[k] for k in (
                   "top1_agreement", "disagreements", "disagreements_with_ref_margin_below_noise",
                   "disagreements_with_ref_deficit_below_noise", "agreement_where_ref_margin_above_noise",
                   "lsm_noise", "max_lsm_diff", "median_lsm_diff", "max_rel_err", "median_rel_err",
                   "reference_rerun_top1_matches")}
               | {"median_rel_err_over_one_ulp_control": float(f"{tf['median_rel_err'] / one_ulp:.4g}"),
                  "prefill_rel_err": tf["prefill"]["rel_err"],
                  "rel_err_mean_first_last_window": [w and float(f"{w['mean']:.4g}") for w in
                                                     (tf["rel_err_first_window"], tf["rel_err_last_window"])]}}
    print(json.dumps(summary), flush=True)
    return report


if __name__ == "__main__":
    main()
