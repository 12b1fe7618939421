"""Vision Transformers trained with DeepSpeed (ZeRO, pipeline) or plain PyTorch DDP."""
import os
import sys

# DeepSpeed JIT-builds small ops (the CPU shared-memory comm op, CPU Adam) into this cache. Its key
# includes the interpreter's path, so two environments sharing one cache rebuild each other's ops.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
