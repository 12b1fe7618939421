"""No torch.distributed collective in vit/ is handed a tensor made on the host: on GPUs the process
group is NCCL's alone (vit.runtime.dist_env), which serves CUDA tensors only, so such a collective
stops every GPU run where it is reached, though every CPU (gloo) test passes (issue 51: diloco's
measure_window all-gathered host float64s). A check of the source, as no GPU is here to run it."""

import ast

from helpers import ROOT

# the collectives that take tensors (the *_object ones move their objects to the device themselves)
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "reduce", "send", "recv", "isend", "irecv",
    "all_to_all", "all_to_all_single", "gather", "scatter",
}  # fmt: skip
# torch's constructors, on the host unless given device=
MAKERS = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn"}
MOVES = {"to", "cuda"}  # a method that puts its tensor on a device
# A host tensor is right on a group whose backend serves it: the asynchronous pipeline's headers
# travel on a gloo group beside the job's (p2p.py makes it with backend="gloo").
GLOO_GROUPS = {"vit/engines/async_pipeline/p2p.py": "self.headers"}


def dist_names(tree: ast.Module) -> tuple[set, dict]:
    """The module's names of torch.distributed (import ... as) and of its functions imported by
    name ({local name: function})."""
    modules, functions = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            functions |= {a.asname or a.name: a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return modules, functions


def collective(call: ast.Call, modules: set, functions: dict) -> str | None:
    """The collective `call` calls (dist.all_reduce, torch.distributed.all_reduce, all_reduce
    imported by name), or None."""
    f = call.func
    if isinstance(f, ast.Name):
        name = functions.get(f.id)
    elif isinstance(f, ast.Attribute):
        owner = ast.unparse(f.value)
        name = f.attr if owner in modules or owner == "torch.distributed" else None
    else:
        name = None
    return name if name in COLLECTIVES else None


class Scope:
    """What an expression's names were last assigned before a line: the enclosing functions' local
    names (innermost first), and `self.<attr>` anywhere in the module."""

    def __init__(self, functions: list, tree: ast.Module):
        self.functions, self.tree = functions, tree

    def name(self, name: str, line: int) -> tuple[int, ast.expr] | None:
        for fn in reversed(self.functions):
            found = [
                (node.lineno, node.value)
                for node in ast.walk(fn)
                if isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.value is not None
                and node.lineno < line
                and name in targets(node)
            ]
            if found:
                return max(found, key=lambda f: f[0])
        return None

    def attribute(self, attr: str) -> list:
        return [
            node.value
            for node in ast.walk(self.tree)
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            and node.value is not None
            and f"self.{attr}" in targets(node)
        ]


def targets(node) -> set:
    """The names an assignment binds (`x`, `self.x`, and those of a tuple on the left)."""
    found = set()
    for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
        for leaf in ast.walk(t):
            if isinstance(leaf, (ast.Name, ast.Attribute)):
                found.add(ast.unparse(leaf))
    return found


def on_host(expr: ast.expr, scope: Scope, line: int, depth: int = 0) -> bool:
    """Whether `expr` is a tensor (or a list of tensors) made on the host: one of torch's
    constructors without device=, in a list or comprehension, through methods other than .to and
    .cuda, or a name last assigned one."""
    if depth > 8:
        return False

    def again(e):
        return on_host(e, scope, line, depth + 1)

    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        f = expr.func
        if ast.unparse(f.value) == "torch" and f.attr in MAKERS:
            return not any(k.arg == "device" for k in expr.keywords)
        return f.attr not in MOVES and again(f.value)
    if isinstance(expr, (ast.List, ast.Tuple)):
        return any(again(e) for e in expr.elts)
    if isinstance(expr, (ast.ListComp, ast.GeneratorExp)):
        return again(expr.elt)
    if isinstance(expr, ast.BinOp):
        return again(expr.left) or again(expr.right)
    if isinstance(expr, ast.Name):
        assigned = scope.name(expr.id, line)  # its names as they were before that line
        return assigned is not None and on_host(assigned[1], scope, assigned[0], depth + 1)
    if isinstance(expr, ast.Attribute) and ast.unparse(expr.value) == "self":
        return any(again(v) for v in scope.attribute(expr.attr))
    return False


def host_tensors(source: str, path: str = "") -> tuple[list[str], int]:
    """('path:line: the call' of each collective handed a host tensor, the number of collective
    calls seen)."""
    tree = ast.parse(source)
    modules, functions = dist_names(tree)
    found, seen = [], 0

    def visit(node, enclosing):
        nonlocal seen
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            enclosing = [*enclosing, node]
        if isinstance(node, ast.Call) and collective(node, modules, functions):
            seen += 1
            group = next((k.value for k in node.keywords if k.arg == "group"), None)
            gloo = group is not None and GLOO_GROUPS.get(path) == ast.unparse(group)
            scope = Scope(enclosing, tree)
            args = [*node.args, *(k.value for k in node.keywords)]
            if not gloo and any(on_host(a, scope, node.lineno) for a in args):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, enclosing)

    visit(tree, [])
    return found, seen


def test_no_collective_in_vit_is_handed_a_tensor_made_on_the_host():
    found, seen = [], 0
    for path in sorted((ROOT / "vit").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        more, n = host_tensors(path.read_text(), rel)
        found, seen = found + more, seen + n
    assert seen >= 20, f"only {seen} collective calls seen in vit/: is the check still reading it?"
    assert not found, "host tensors handed to collectives (NCCL takes CUDA tensors only):\n" + (
        "\n".join(found)
    )
    # the gloo rule's group is still made with gloo
    for rel, group in GLOO_GROUPS.items():
        assert 'backend="gloo"' in (ROOT / rel).read_text(), (rel, group)


def test_the_check_sees_a_host_tensor_inline_by_name_or_in_a_list():
    bad = """
import torch
import torch.distributed as dist
from torch.distributed import all_reduce

def window(mine, n):
    times = [torch.zeros(1, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(times, torch.tensor([mine], dtype=torch.float64, device="cuda"))

def named(x):
    t = torch.tensor([x]).double()
    all_reduce(t)

class Sums:
    def __init__(self):
        self.sums = torch.zeros(3)

    def take(self):
        total = self.sums.clone()
        torch.distributed.all_reduce(total)
"""
    found, seen = host_tensors(bad, "bad.py")
    assert seen == 3 and [f.split(":")[1] for f in found] == ["8", "12", "20"], found
    good = """
import torch
import torch.distributed as dist

def window(mine, n, device, group):
    mine = torch.tensor([mine], dtype=torch.float64, device=device)
    times = [torch.zeros_like(mine) for _ in range(n)]
    dist.all_gather(times, mine)
    peak = torch.tensor([2.0]).to(device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_gather_object([None] * n, torch.tensor([1.0]))
"""
    found, seen = host_tensors(good, "good.py")
    assert seen == 2 and not found, found
