"""The model floor: the decoder as a plain module, its config and RoPE tables, loading and
fetching checkpoints, and the CPU matmul plans its Linear layers run."""
