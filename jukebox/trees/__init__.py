"""The host's real trees: the one a run starts from and the one a booth commits into."""
