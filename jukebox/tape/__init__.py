"""Tapes: frames, the tamper-evident log, where tapes live, and reading them."""
