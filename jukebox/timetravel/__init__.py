"""Time travel: re-executing a recorded booth run and forking it."""
