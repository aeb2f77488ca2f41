"""The policy protocol and registry, the flat-MLP actor-critic, the encoder networks for images and Dict
observations, and the recurrent (LSTM/GRU) actor-critic. Importing this package registers every built-in policy type.
"""

from ppokit.policies.actor_critic import (
                                          ACTIVATIONS,
                                          MASKED_LOGIT,
                                          ActorCritic,
                                          Policy,
                                          PolicyBase,
                                          StatefulPolicy,
                                          action_spec,
                                          frozen_copy,
                                          layer_init,
                                          mask_logits,
)
from ppokit.policies.build import build_policy, config_policy
from ppokit.policies.encoder_networks import EncoderActorCritic
from ppokit.policies.recurrent import RecurrentActorCritic
from ppokit.policies.registry import (
                                          DEFAULT_POLICY_TYPE,
                                          PolicySpecError,
                                          policy_from_spec,
                                          policy_types,
                                          register_policy,
                                          spec_type,
)

__all__ = ["ACTIVATIONS", "DEFAULT_POLICY_TYPE", "MASKED_LOGIT", "ActorCritic", "EncoderActorCritic", "Policy",
           "PolicyBase", "PolicySpecError", "RecurrentActorCritic", "StatefulPolicy", "action_spec", "build_policy",
           "config_policy", "frozen_copy", "layer_init",
           "mask_logits", "policy_from_spec", "policy_types", "register_policy", "spec_type"]
