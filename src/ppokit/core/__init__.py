"""Pure PPO math and the definitions everything shares: objectives, advantages, reductions, the algorithm
registry, the metric schema with its thresholds, errors. Imports torch and numpy only.
"""
