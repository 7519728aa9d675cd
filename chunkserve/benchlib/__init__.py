"""What the real benchmarks (`bench/`) and the simulator (`sim/`) share: workloads, the replay
loop, vLLM's metrics, sweep configurations and their report. Declared once, so a simulated
sweep and a measured one read the same flags and write the same numbers."""
