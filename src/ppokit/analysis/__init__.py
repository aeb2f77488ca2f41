"""Reading a run after it trains: the doctor and its rules (Gymnasium and LM), the HTML report and multi-seed
experiments.
"""
