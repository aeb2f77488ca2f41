"""Choosing the policy class for an env's spaces."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ppokit.envs.encoders import observation_encoder
from ppokit.policies.actor_critic import ActorCritic, action_spec
from ppokit.policies.encoder_networks import EncoderActorCritic

__all__ = ["build_policy", "policy_parameters"]


def build_policy(observation_space, action_space, hidden_sizes: list[int], activation: str) -> nn.Module:
    """The policy for single-env Gymnasium spaces, chosen by the observation encoder (see ``encoders``): an
    ``ActorCritic`` MLP over a flat encoding (a flattened Box, a one-hot Discrete), else an
    ``encoder_networks.EncoderActorCritic`` (image: the Nature CNN; Dict/Tuple: a CNN per image, an MLP over the
    rest)."""
    encoder = observation_encoder(observation_space)  # ValueError naming the space (or part) it cannot encode
    kind, dims = action_spec(action_space)
    if not encoder.structured and encoder.layout()[1] == torch.float32:
        return ActorCritic(encoder.flat_dim, kind, dims, hidden_sizes, activation, obs_encoding=encoder.spec())
    return EncoderActorCritic(encoder.spec(), kind, dims, hidden_sizes, activation)


def policy_parameters(observation_space: Any, action_space: Any, hidden_sizes: list[int], activation: str) -> int:
    """Parameters of the policy ``policies.build_policy`` makes for these spaces, counted on torch's meta device
    (shapes only: nothing is allocated and no random number is drawn, so a 10^10-parameter network costs
    nothing to count)."""
    with torch.device("meta"):
        policy = build_policy(observation_space, action_space, hidden_sizes, activation)
    return sum(p.numel() for p in policy.parameters())
