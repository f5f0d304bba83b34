"""Compute backends for the hot spots of a forward pass.

`moe_torch`: the fused-MoE routing and expert computation as vectorised torch (the CPU backend).
`fused_moe_triton`: the same as Triton kernels (GPU; CPU only in Triton's interpreter), with their
block sizes from `moe_configs` (tuned by `moe_tune`). `fp8`: the FP8 numbers both it and the FP8
layers use. See README.md.
"""
