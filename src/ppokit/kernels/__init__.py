"""The opt-in fast path for flat MLP policies: cached acting weights, the hand-derived loss backward, FlatAdam
and the fused update step. Each is checked against the eager autograd reference.
"""
