"""Weight prediction for the asynchronous pipeline (FTPipe's multi-step NAG): the weights a stage will hold d
updates from now if the gradients to come added nothing new, read from the optimizer's momentum."""
import torch


@torch.no_grad()
def predict(optimizer: torch.optim.Optimizer, d: int) -> dict:
    """{parameter: its predicted value d updates ahead}, new tensors; the parameters themselves are untouched."""
    sgd = isinstance(optimizer, torch.optim.SGD)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out[p] = sgd_ahead(p, state, group, d) if sgd else adamw_ahead(p, state, group, d)
    return out


def sgd_ahead(p: torch.Tensor, state: dict, group: dict, d: int) -> torch.Tensor:
    """θ − lr·(γ − γ^{d+1})/(1 − γ)·v: the momentum buffer v decaying by γ for d steps."""
    v, gamma = state.get("momentum_buffer"), group["momentum"]
    if v is None or gamma == 0:
        return p.detach().clone()
    coef = float(group["lr"]) * (gamma - gamma ** (d + 1)) / (1 - gamma)
    return p.detach() - coef * v


def adamw_ahead(p: torch.Tensor, state: dict, group: dict, d: int) -> torch.Tensor:
    """AdamW's update d times with exp_avg and exp_avg_sq decaying (no new gradient), bias-corrected at each of
    the steps to come, weight decay included."""
    theta = p.detach().clone()
    if "exp_avg" not in state:
        return theta
    lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    step = float(state["step"])
    for i in range(1, d + 1):
        exp_avg, exp_avg_sq = state["exp_avg"] * beta1 ** i, state["exp_avg_sq"] * beta2 ** i
        correction1, correction2 = 1 - beta1 ** (step + i), 1 - beta2 ** (step + i)
        theta.mul_(1 - lr * wd)
        theta.addcdiv_(exp_avg, (exp_avg_sq / correction2).sqrt_().add_(eps), value=-lr / correction1)
    return theta
