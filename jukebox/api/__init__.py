"""The Python API: Jukebox, transactions, the agent's memory, and the B side of a fork."""
