"""Compute backends for the hot spots of a forward pass.

`moe_torch`: the fused-MoE expert computation as vectorised torch (the CPU backend).
"""
