"""A vLLM engine with the kvtier connector that takes each batch of prompts at once (vLLM's
offline `LLM`): every prompt of a batch is queued before the engine's first step, so prompts
sharing a prefix are scheduled in the same step (over HTTP that is a race).

    python -m tests.helpers.batch_engine MODEL L2_DIR

Reads batches from stdin, one JSON line each: a list of prompts, each a list of token ids or
`{"prompt_token_ids": [...], "cache_salt": "s"}`. For each batch it generates greedily
(`max_tokens` 4) and prints one line, `OUTPUT_MARK` then JSON: the outputs' token ids (vLLM
logs to stdout too). Two commands instead print an empty list:
`{"abort_after_one_step": PROMPT}` runs one engine step with that prompt and aborts it (the
engine core runs in this process, so a step is exactly one schedule, forward pass and update);
`{"new_weights": SCALE}` multiplies the weights of the norm before every attention layer by
SCALE, then resets the caches as an RLHF weight sync does (vLLM's prefix cache and the
connector's). It exits at the end of stdin; the connector's L2 writes still queued then may
be lost, so the caller waits for the files it needs before closing stdin
(`tests.helpers.engines.BatchEngine`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvtier.vllm.launch import patch_vllm_cpu, tune_message_queue
from tests.helpers.engines import OUTPUT_MARK

patch_vllm_cpu()  # (also in the engine processes vLLM spawns, which import this as __mp_main__)
tune_message_queue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("l2_dir")
    args = parser.parse_args()

    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvtier.tools.vllm_server import resolve_dtype
    from kvtier.vllm.settings import ConnectorSettings, kv_transfer_config
    from vllm import LLM, SamplingParams

    settings = ConnectorSettings(l2_path=args.l2_dir, l1_bytes=1 << 30, background_cpus="inherit")
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        max_model_len=4096,
        dtype=resolve_dtype("auto"),  # type: ignore[arg-type]  # (a str of vLLM's choices)
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(settings)),
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    for line in sys.stdin:
        batch = json.loads(line)
        if isinstance(batch, dict) and "new_weights" in batch:
            llm.collective_rpc(_scale_attention, args=(batch["new_weights"],))
            _reset_caches(llm)
            print(OUTPUT_MARK + "[]", flush=True)
            continue
        if isinstance(batch, dict):
            engine = llm.llm_engine
            engine.add_request(
                "aborted", TokensPrompt(prompt_token_ids=batch["abort_after_one_step"]), greedy
            )
            engine.step()
            engine.abort_request(["aborted"])
            print(OUTPUT_MARK + "[]", flush=True)
            continue
        prompts = [
            TokensPrompt(prompt_token_ids=p)
            if isinstance(p, list)
            else TokensPrompt(prompt_token_ids=p["prompt_token_ids"], cache_salt=p["cache_salt"])
            for p in batch
        ]
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        print(OUTPUT_MARK + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


def _scale_attention(worker: Any, scale: float) -> None:
    """(Runs in the worker.) New weights in place: the norm before each attention layer times
    `scale`, so its queries, keys and values are too. (The CPU build repacks the projections'
    weights for its matrix kernels: scaling their parameters would change nothing.)"""
    for name, param in worker.model_runner.model.named_parameters():
        if "input_layernorm" in name:
            param.data.mul_(scale)


def _reset_caches(llm: Any, timeout_s: float = 60.0) -> None:
    """vLLM's prefix cache and the connector's, as after a weight sync. vLLM refuses while a
    finished request keeps its blocks for saves in flight, which the connector reports done
    in an engine step (a server keeps stepping until then before a pause completes)."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache(reset_connector=True):
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM refused to reset its prefix cache")
        llm.llm_engine.step()
        time.sleep(0.05)


if __name__ == "__main__":
    main()
