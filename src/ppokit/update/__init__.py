"""One PPO update: the K-epoch minibatch loop and the eager-autograd minibatch step (the reference for every
fast path).
"""
