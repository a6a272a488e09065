"""Choosing experts: routing functions, the engine-routed MoE block, prerouter heads and their state."""
