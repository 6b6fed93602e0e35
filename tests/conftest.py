"""Suite-wide settings: never reach a model hub; vLLM in CPU CI mode."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
