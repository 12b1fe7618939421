"""Vision Transformers trained with DeepSpeed (ZeRO, pipeline) or plain PyTorch DDP."""
import os
import sys

# DeepSpeed JIT-builds small ops (the CPU shared-memory comm op, CPU Adam) into this cache. Its key
# includes the interpreter's path, so two environments sharing one cache rebuild each other's ops.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
# torch builds them with the first `ninja` on PATH. The venv's ninja (pip) and the system's write .ninja_log
# hashes the other cannot read, so runs with and without the venv on PATH (entry_cn.sh activates it, a bare
# .venv/bin/python does not) rebuilt the op every time, a minute or more of CPU each: use the venv's.
_bin = os.path.dirname(sys.executable)
if os.path.isfile(os.path.join(_bin, "ninja")) and not os.environ.get("PATH", "").startswith(_bin + os.pathsep):
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")
