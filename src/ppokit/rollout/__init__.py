"""The rollout side: the env-stepping loop (``loop``) and its users (the collector that fills the buffer with
pi_old's steps, the one-env fast path, the evaluations), the preallocated buffer, observation and reward
normalizers, and the rollout-source protocol the learner pulls from (``source``).
"""
