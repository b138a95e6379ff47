"""The vLLM e2e suite: single-threaded torch in this process (fair on a shared machine)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
