"""Seeding the global random number generators every run starts from (Python, numpy, torch)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch global RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
