"""Choosing the policy class for an env's spaces (and a run's config)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ppokit.envs.encoders import observation_encoder
from ppokit.policies.actor_critic import ActorCritic, action_spec
from ppokit.policies.encoder_networks import EncoderActorCritic
from ppokit.policies.recurrent import RecurrentActorCritic

__all__ = ["build_policy", "config_policy", "default_init", "policy_parameters"]


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


def config_policy(observation_space: Any, action_space: Any, config: Any) -> nn.Module:
    """The policy a run's ``config`` asks for: ``build_policy``'s, or with ``config.recurrent`` ("lstm" | "gru")
    a ``recurrent.RecurrentActorCritic`` after the same encoder (``recurrent_hidden`` units, the critic's core
    ``recurrent_critic``, heads of ``hidden_sizes``); with ``ortho_init`` False every layer gets PyTorch's
    default init instead (``default_init``)."""
    recurrent = getattr(config, "recurrent", "none")
    if recurrent == "none":
        policy = build_policy(observation_space, action_space, config.hidden_sizes, config.activation)
    else:
        encoder = observation_encoder(observation_space)
        kind, dims = action_spec(action_space)
        policy = RecurrentActorCritic(encoder.flat_dim, kind, dims, config.hidden_sizes, config.activation,
                                      obs_encoding=encoder.spec(), cell=recurrent,
                                      recurrent_hidden=config.recurrent_hidden, critic=config.recurrent_critic)
    if not getattr(config, "ortho_init", True):
        default_init(policy)
    return policy


def default_init(policy: nn.Module) -> nn.Module:
    """Every layer of ``policy`` re-initialized by PyTorch's own ``reset_parameters`` (uniform in +-1/sqrt(fan_in)
    for linear, convolution and recurrent layers): Stable-Baselines3's ``ortho_init=False``, which RL-Zoo's
    recurrent CartPoleNoVel-v1 settings use. A continuous policy's log-std stays 0."""
    for module in policy.modules():
        if module is not policy and isinstance(module, (nn.Linear, nn.Conv2d, nn.RNNBase)):
            module.reset_parameters()
    return policy


def policy_parameters(observation_space: Any, action_space: Any, hidden_sizes: list[int], activation: str,
                      config: Any = None) -> int:
    """Parameters of the policy ``build_policy`` (or, given ``config``, ``config_policy``) makes for these spaces,
    counted on torch's meta device (shapes only: nothing is allocated and no random number is drawn, so a
    10^10-parameter network costs nothing to count)."""
    with torch.device("meta"):
        policy = build_policy(observation_space, action_space, hidden_sizes, activation) if config is None \
            else config_policy(observation_space, action_space, config)
    return sum(p.numel() for p in policy.parameters())
