"""`chunkserve diagnose`: why were the slowest token gaps of a step trace slow."""
