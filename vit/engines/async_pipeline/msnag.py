"""Weight prediction for the asynchronous pipeline (FTPipe's multi-step NAG): the weights a stage
will hold d updates from now if the gradients to come added nothing new, read from the optimizer's
momentum."""

import torch


@torch.no_grad()
def predict(optimizer: torch.optim.Optimizer, d: int) -> dict:
    """{parameter: its predicted value d updates ahead}, new tensors; the parameters themselves are
    untouched."""
    sgd = isinstance(optimizer, torch.optim.SGD)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out[p] = sgd_ahead(p, state, group, d) if sgd else adamw_ahead(p, state, group, d)
    return out


def sgd_ahead(p: torch.Tensor, state: dict, group: dict, d: int) -> torch.Tensor:
    """SGD's update d times with no new gradient but weight decay's: without weight decay and
    Nesterov that is θ − lr·(γ − γ^{d+1})/(1 − γ)·v, the momentum buffer v decaying by γ; with
    Nesterov each step also looks ahead (γ·v); with weight decay wd·θ is the gradient, and starts
    the buffer if no update has yet."""
    lr, gamma, wd, damp = (
        float(group["lr"]),
        group["momentum"],
        group["weight_decay"],
        group["dampening"],
    )
    theta, v = p.detach().clone(), state.get("momentum_buffer")
    for _ in range(d):
        g = theta * wd
        if gamma:
            v = g.clone() if v is None else v * gamma + g * (1 - damp)
            g = g + v * gamma if group["nesterov"] else v
        theta.sub_(g, alpha=lr)
    return theta


def adamw_ahead(p: torch.Tensor, state: dict, group: dict, d: int) -> torch.Tensor:
    """AdamW's update d times with exp_avg and exp_avg_sq decaying (no new gradient), bias-corrected
    at each of the steps to come, weight decay included (alone, before the first update)."""
    theta = p.detach().clone()
    lr, (beta1, beta2), eps, wd = (
        float(group["lr"]),
        group["betas"],
        group["eps"],
        group["weight_decay"],
    )
    if "exp_avg" not in state:
        return theta.mul_((1 - lr * wd) ** d)
    step = float(state["step"])
    for i in range(1, d + 1):
        exp_avg, exp_avg_sq = state["exp_avg"] * beta1**i, state["exp_avg_sq"] * beta2**i
        correction1, correction2 = 1 - beta1 ** (step + i), 1 - beta2 ** (step + i)
        theta.mul_(1 - lr * wd)
        theta.addcdiv_(
            exp_avg, (exp_avg_sq / correction2).sqrt_().add_(eps), value=-lr / correction1
        )
    return theta
