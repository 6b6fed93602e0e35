"""A vLLM engine with the kvtier connector that takes each batch of prompts at once (vLLM's
offline `LLM`): every prompt of a batch is queued before the engine's first step, so prompts
sharing a prefix are scheduled in the same step (over HTTP that is a race).

    python -m tests.helpers.batch_engine MODEL L2_DIR

Reads batches from stdin, one JSON line each: a list of token-id prompts. For each batch it
generates greedily (`max_tokens` 4) and prints one line, `OUTPUT_MARK` then JSON: the outputs'
token ids (vLLM logs to stdout too). A line `{"abort_after_one_step": PROMPT}` instead runs
one engine step with that prompt, aborts it, and prints an empty list (the engine core runs
in this process, so a step is exactly one schedule, forward pass and update). It exits at the
end of stdin; the connector's L2 writes still queued then may be lost, so the caller waits for
the files it needs before closing stdin (`tests.helpers.engines.BatchEngine`).
"""

from __future__ import annotations

import argparse
import json
import sys

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
        if isinstance(batch, dict):
            engine = llm.llm_engine
            engine.add_request(
                "aborted", TokensPrompt(prompt_token_ids=batch["abort_after_one_step"]), greedy
            )
            engine.step()
            engine.abort_request(["aborted"])
            print(OUTPUT_MARK + "[]", flush=True)
            continue
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in batch]
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        print(OUTPUT_MARK + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":
    main()
