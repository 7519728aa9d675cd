"""The simulator: its own speed, and `chunkserve tune`'s pick against real measurements."""
