"""Shared pytest setup: single-threaded torch (deterministic, fair on 2 cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
