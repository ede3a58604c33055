"""What the decoder calls per layer, beside its Linear projections: `RMSNorm` (norm.py, the
residual add fused in) and `StepRope` (rotary.py, the once-per-step RoPE gather). Each op
they run comes from the forward's ops table (`kernels/ops.py`: the torch reference or the
Triton kernel, one switch per engine); the references and kernels live in `kernels/`.
"""
