"""Vision Transformers trained with DeepSpeed (ZeRO, pipeline) or plain PyTorch DDP."""
