"""The rollout side: the collector that steps the envs with pi_old, the one-env fast path, the preallocated
buffer, observation and reward normalizers, and the rollout-source protocol the learner pulls from.
"""
