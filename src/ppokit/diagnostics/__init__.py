"""Reading a run while it trains: the live monitor's alerts and the plots.
"""
