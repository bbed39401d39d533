"""Bare vLLM on the demo model, for the tests to compare the fleet's vLLM worker with.

Runs in .venv-vllm: ``python -m tests.vllm_reference MODEL_DIR < requests.json`` where each
request is ``{"prompt": ..., "max_new_tokens": ...}``; prints one JSON list of
``{"text", "finish_reason", "completion_tokens"}``. Greedy, all requests in one
``LLM.generate`` call, the same prompt ids as the fleet (the checkpoint's own tokenizer).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    model = sys.argv[1]
    requests = json.load(sys.stdin)
    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="bfloat16", max_num_seqs=16, seed=0)
    prompts = [{"prompt_token_ids": tokenizer(r["prompt"])["input_ids"]} for r in requests]
    params = [SamplingParams(max_tokens=r["max_new_tokens"], temperature=0) for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = [
        {
            "text": o.outputs[0].text,
            "finish_reason": o.outputs[0].finish_reason,
            "completion_tokens": len(o.outputs[0].token_ids),
        }
        for o in outputs
    ]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
