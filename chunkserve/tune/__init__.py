"""`chunkserve tune`: the chunking configuration for a model, hardware, workload and SLOs."""
