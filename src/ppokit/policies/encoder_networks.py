"""Policies over encoded observations that are not one flat vector: images (the Nature CNN) and Dict/Tuple.

``EncoderActorCritic`` (registered as ``"encoder_actor_critic"``) reads what ``encoders.observation_encoder``
makes of the observation space: an image ``[B, C, H, W]`` uint8 tensor, or a dict of parts (images, float
vectors, one-hot codes). A trunk shared by the actor and the critic turns it into one feature vector, two linear
heads read it:

* every image part goes through its own Nature CNN (Mnih et al. 2015, "Human-level control through deep
  reinforcement learning", Methods: conv 32 8x8 stride 4, conv 64 4x4 stride 2, conv 64 3x3 stride 1, linear 512,
  ReLU after each), the pixels scaled by 1/255 INSIDE the model, so the buffer keeps bytes;
* the vector parts (Box vectors flattened, Discrete one-hot) are concatenated and go through one MLP
  (``hidden_sizes``, ``activation``);
* the features are concatenated; the actor head (orthogonal gain 0.01) gives logits or the Gaussian mean, the
  critic head (gain 1) the value. Hidden layers get orthogonal gain sqrt(2) and zero bias.

Sharing the trunk between actor and critic is the Atari PPO setup ("The 37 implementation details of PPO",
Huang et al. 2022, Atari detail "shared Nature-CNN network"); the value and policy losses then both shape it (with
``vf_coef`` weighing them). These policies train by autograd: the fused update and the acting kernel apply only
to the flat-MLP ``ActorCritic`` (``mlp_backward.unsupported_reason`` says so for any other policy).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ppokit.envs.encoders import DictEncoder, ImageEncoder, encoder_from_spec
from ppokit.policies.actor_critic import ACTIVATIONS, PolicyBase, layer_init
from ppokit.policies.registry import register_policy

__all__ = ["NatureCNN", "ObservationTrunk", "EncoderActorCritic"]

CNN_FEATURES = 512


class NatureCNN(nn.Module):
    """``[B, C, H, W]`` uint8 pixels -> ``[B, 512]`` features; the 1/255 scaling is the first op of ``forward``."""

    def __init__(self, channels: int, height: int, width: int):
        super().__init__()
        gain = math.sqrt(2.0)
        self.convs = nn.Sequential(
            _conv_init(nn.Conv2d(channels, 32, 8, stride=4), gain), nn.ReLU(),
            _conv_init(nn.Conv2d(32, 64, 4, stride=2), gain), nn.ReLU(),
            _conv_init(nn.Conv2d(64, 64, 3, stride=1), gain), nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():  # the flattened size for this image size (7x7x64 = 3136 for 84x84)
            n_flat = self.convs(torch.zeros(1, channels, height, width)).shape[1]
        self.linear = nn.Sequential(layer_init(nn.Linear(n_flat, CNN_FEATURES), gain), nn.ReLU())

    def forward(self, pixels: Tensor) -> Tensor:
        # Bytes to [0, 1] here, not in the env or the buffer: the rollout stores 1 byte per pixel, not 4.
        return self.linear(self.convs(pixels.float() / 255.0))


def _conv_init(conv: nn.Conv2d, gain: float) -> nn.Conv2d:
    nn.init.orthogonal_(conv.weight, gain)
    nn.init.constant_(conv.bias, 0.0)
    return conv


class ObservationTrunk(nn.Module):
    """The shared trunk: a CNN per image part, one MLP over the concatenated vector parts, features concatenated."""

    def __init__(self, encoder: ImageEncoder | DictEncoder, hidden_sizes: list[int], activation: str):
        super().__init__()
        self.single_image = isinstance(encoder, ImageEncoder)
        parts = {"": encoder} if self.single_image else encoder.parts
        self.image_keys = [k for k, p in parts.items() if isinstance(p, ImageEncoder)]
        self.vector_keys = [k for k, p in parts.items() if not isinstance(p, ImageEncoder)]
        self.cnns = nn.ModuleList([NatureCNN(*parts[k].chw) for k in self.image_keys])
        self.out_dim = CNN_FEATURES * len(self.image_keys)
        self.mlp: nn.Module | None = None
        if self.vector_keys:
            last = sum(parts[k].flat_dim for k in self.vector_keys)
            layers: list[nn.Module] = []
            for width in hidden_sizes:
                layers += [layer_init(nn.Linear(last, width), math.sqrt(2.0)), ACTIVATIONS[activation]()]
                last = width
            self.mlp = nn.Sequential(*layers)  # empty (the identity) when hidden_sizes is []
            self.out_dim += last

    def forward(self, obs: Tensor | dict[str, Tensor]) -> Tensor:
        """``obs`` (an image tensor, or a dict of parts) -> ``[B, out_dim]`` features."""
        if self.single_image:
            return self.cnns[0](obs)
        feats = [cnn(obs[k]) for k, cnn in zip(self.image_keys, self.cnns)]
        if self.mlp is not None:
            vec = torch.cat([obs[k] for k in self.vector_keys], -1) if len(self.vector_keys) > 1 \
                else obs[self.vector_keys[0]]
            feats.append(self.mlp(vec))
        return feats[0] if len(feats) == 1 else torch.cat(feats, -1)


class EncoderActorCritic(PolicyBase):
    """Actor and critic heads over a shared ``ObservationTrunk`` (images through CNNs, vectors through an MLP).

    ``obs_encoding`` is the observation encoder's spec (``encoders``); ``kind``/``action_dims`` as for
    ``ActorCritic``. ``obs_dim`` (optional, checked) is the encoder's total element count.
    """

    def __init__(self, obs_encoding: dict, kind: str, action_dims: list[int], hidden_sizes: list[int],
                 activation: str = "tanh", obs_dim: int | None = None):
        super().__init__(kind, action_dims)
        encoder = encoder_from_spec(obs_encoding)
        if not isinstance(encoder, (ImageEncoder, DictEncoder)):
            raise ValueError(f"EncoderActorCritic needs an image or Dict/Tuple observation encoding, got "
                             f"{obs_encoding!r} (a flat observation is an ActorCritic)")
        if obs_dim is not None and int(obs_dim) != encoder.flat_dim:
            raise ValueError(f"obs_dim {obs_dim} does not match the observation encoding ({encoder.flat_dim})")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        self.obs_encoding, self.obs_dim = obs_encoding, encoder.flat_dim
        self.hidden_sizes, self.activation = list(hidden_sizes), activation
        self.trunk = ObservationTrunk(encoder, self.hidden_sizes, activation)
        self.actor_head = layer_init(nn.Linear(self.trunk.out_dim, self.n_out), 0.01)
        self.critic_head = layer_init(nn.Linear(self.trunk.out_dim, 1), 1.0)
        if kind == "continuous":
            self.log_std = nn.Parameter(torch.zeros(action_dims[0]))

    def actor(self, obs) -> Tensor:
        """The actor's output (logits or the Gaussian mean) ``[B, n_out]``."""
        return self.actor_head(self.trunk(obs))

    def value(self, obs, state: None = None, episode_start: Any = None) -> Tensor:
        """State values ``[B]`` (stateless: ``state`` and ``episode_start`` are ignored)."""
        return self.critic_head(self.trunk(obs)).squeeze(-1)

    def act(self, obs, state: None, episode_start: Any, action_mask: Tensor | None = None,
            deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, None]:
        """``(actions, logp [B], values [B], None)`` with one trunk pass; call under ``torch.inference_mode``.
        Stateless: ``state`` (None) and ``episode_start`` are ignored (``Policy``)."""
        features = self.trunk(obs)
        head = self.apply_mask(self.actor_head(features), action_mask)
        actions = self.sample(head, deterministic)
        logp, _ = self.log_prob_entropy(head, actions)
        return actions, logp, self.critic_head(features).squeeze(-1), None

    def evaluate(self, obs, actions: Tensor,
                 action_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(logp_new [B], entropy [B], values [B])`` of stored ``actions`` under pi_theta, one trunk pass."""
        features = self.trunk(obs)
        logp, ent = self.log_prob_entropy(self.apply_mask(self.actor_head(features), action_mask), actions)
        return logp, ent, self.critic_head(features).squeeze(-1)

    def spec(self) -> dict:
        return {"type": "encoder_actor_critic", "obs_encoding": self.obs_encoding, "obs_dim": self.obs_dim,
                "kind": self.kind, "action_dims": self.action_dims, "hidden_sizes": self.hidden_sizes,
                "activation": self.activation}


register_policy("encoder_actor_critic", EncoderActorCritic)
