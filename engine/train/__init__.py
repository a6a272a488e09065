"""Training: phase 0 (the demo base), 1 (heads), 2 (LoRA SFT), 3 (on-policy), and synthetic models."""
