"""What a person reads before a commit: line diffs, excluded paths, host hooks."""
