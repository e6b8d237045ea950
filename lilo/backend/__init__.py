"""The torch multi-LoRA backend: base models, multi-LoRA layers, losses, optimizer slots, sampling, checkpoints."""
