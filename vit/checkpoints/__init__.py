"""Checkpoints: written whole or not at all, loaded only when every file checks out, and resumed on
another layout through DeepSpeed's universal checkpoint."""
