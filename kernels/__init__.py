"""Compute backends for the hot spots of a forward pass.

`moe_torch`: the fused-MoE routing and expert computation as vectorised torch (the CPU backend).
`fused_moe_triton`: the same as Triton kernels (GPU; CPU only in Triton's interpreter), with their
block sizes from `moe_configs`. See README.md.
"""
