"""Per-layer cost of the network: forward FLOPs, activation bytes kept for backward, parameters; and the memory
rules the planners share."""
import torch
from torch import nn

BYTES_PER_PARAM = 16  # fp32 weights, gradients and two AdamW moments; or half weights + grads + fp32 master
USABLE_MEMORY = 0.9  # plans leave 10% of the free memory for the allocator, workspaces and the unforeseen


def activation_factor(precision: str) -> float:
    """Activations are profiled in fp32; half precision keeps half the bytes."""
    return 0.5 if precision in ("fp16", "bf16") else 1.0


def profile_layers(layers: list[nn.Module], sample: torch.Tensor) -> list[dict]:
    """Per layer and per sample: forward FLOPs, bytes kept for backward (activations), parameter count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    out, x = [], sample
    with torch.random.fork_rng():
        for layer in layers:
            own = {p.untyped_storage().data_ptr() for p in layer.parameters()}
            saved = {}

            def pack(t):
                s = t.untyped_storage()
                if s.data_ptr() not in own:
                    saved[s.data_ptr()] = s.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x)
            counter = FlopCounterMode(display=False)
            with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):  # the math kernel's matmuls are counted
                layer(x)
            out.append({"name": type(layer).__name__, "flops": counter.get_total_flops(),
                        "act_bytes": sum(saved.values()), "params": sum(p.numel() for p in layer.parameters())})
            x = y.detach().requires_grad_()
    return out
