"""Shared test setup: one CPU thread (the CI box has two cores shared by several jobs) and a headless backend."""

from __future__ import annotations

import os

os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402  (after the environment so matplotlib, if imported later, sees MPLBACKEND)

torch.set_num_threads(1)
