"""The Gymnasium trainer: the loop that wires the parts, its checkpoint state and lifecycle, callbacks, and the
``Agent`` a finished run loads as.
"""
