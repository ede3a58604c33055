"""The runtime floor: a ModelRunner per model owns its KV buffer, attention backend, CUDA
graphs and batch-invariant mode; step-cost measurement and the cross-device adapter sit
beside it."""
