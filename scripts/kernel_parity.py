"""Greedy tokens of the full-size random-weight model with one kernels setting, written as JSON, so that two runs
(reference, gpu) in separate processes can be compared; also reports the decode time per token.
"""

import argparse
import json
import time

from qwen_jax.llm import LLM
from qwen_jax.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a directory with config.json (random weights are used)")
    ap.add_argument("--kernels", required=True, choices=("reference", "gpu"))
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", kernels=args.kernels, max_num_seqs=4, max_model_len=1024,
              enable_prefix_caching=False)
    prompts = [[(i * 7919 + 13) % 200000 for i in range(64)], [(i * 104729 + 7) % 200000 for i in range(200)]]
    # top-2 logprobs: where two runs part ways, the reference's top-1 margin there says whether it was a near-tie
    params = SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True, logprobs=2)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))  # compile
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    margins = [[round(lp.top[0][1] - lp.top[1][1], 5) for lp in o.logprobs] for o in outs]
    result = {"kernels": args.kernels, "tokens": [o.token_ids for o in outs], "top2_margins": margins,
              "ms_per_step_batch2": round(1000 * seconds / args.steps, 3)}
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k not in ("tokens", "top2_margins")}))


if __name__ == "__main__":
    main()
