"""Adapters in slots: the multi-LoRA layers and their bank, the fused per-slot AdamW, the slots' memory."""
