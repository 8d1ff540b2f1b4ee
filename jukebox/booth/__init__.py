"""One sandboxed run: the supervisor, its isolation, its layer, and the booth commands."""
