"""Files beside the base: recovery LoRA, K profiles, the metadata every adapter file shares."""
