"""One request's TPOT through the engine (offline LLM, no HTTP) with the default speculative policy and with
speculation off, on full-size random weights: with `--load-format dummy_echo` and greedy decoding the MTP head's
drafts are all accepted, so this is speculative decoding's best case at c=1 on the real shapes.

Never a correctness check (random weights): prints one line per setting. Usage (one GPU):
    python scripts/speculative_tpot_one_request.py --model <35B-A3B config dir> [--load-format dummy_echo]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from qwen_jax import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="dummy_echo")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--settings", default="default,off", help="speculative_config values; 'default': none given")
    args = ap.parse_args()
    # three prompts: warm-up, TTFT, timed; each its own, so none finds the others' pages in the prefix cache
    prompts = [[int(t) for t in np.random.default_rng(seed).integers(1000, 200000, args.prompt_len)]
               for seed in range(3)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for setting in args.settings.split(","):
        llm = LLM(args.model, load_format=args.load_format, max_num_seqs=4, max_num_batched_tokens=2048,
                  max_model_len=args.prompt_len + args.max_tokens + 64,
                  speculative_config=None if setting == "default" else setting)
        llm.generate([prompts[0]], many)  # compiles every program the timed runs use
        t = time.perf_counter()
        llm.generate([prompts[1]], one)
        ttft = time.perf_counter() - t
        before = llm.engine.stats()
        t = time.perf_counter()
        out = llm.generate([prompts[2]], many)[0]
        total = time.perf_counter() - t
        after = llm.engine.stats()
        rounds = after["spec_verified_rows_total"] - before["spec_verified_rows_total"]
        accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
        print(f"speculative_config={setting}: TTFT {ttft * 1e3:.1f} ms, TPOT "
              f"{(total - ttft) / (len(out.token_ids) - 1) * 1e3:.3f} ms over {len(out.token_ids)} tokens, "
              f"{rounds} verify rounds, acceptance length {1 + accepted / max(rounds, 1):.2f}, "
              f"{after['steps_total'] - before['steps_total']} engine steps", flush=True)
        del llm, out
        gc.collect()  # the next engine sizes its cache from the memory this one frees


if __name__ == "__main__":
    main()
