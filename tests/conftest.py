"""Shared test set-up: one torch thread per process (2-core machines run several processes at once)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
