"""What a run needs from its process and disk: data-parallel ranks, the shared-memory reduce, checkpoints,
run directories and the metric sinks.
"""
