"""shadowfs: content-addressed storage and a copy-on-write file-system layer.

This package knows nothing of agents, LLMs or tapes; `jukebox` composes it.
"""
