"""Process lifecycles, in one place: spawn, liveness, join-then-kill, one join timeout, and where
each process runs (CPU cores, GPUs). Every process chunkserve starts (engine processes,
tensor-parallel workers, headless nodes' engines) is started and ended through here."""
