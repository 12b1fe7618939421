"""The LR schedule."""

import pytest

from vit.optim import warmup_cosine


def test_warmup_then_cosine():
    lr = [warmup_cosine(s, total=100, warmup=10, min_ratio=0.01) for s in range(100)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[9:], lr[10:])) and lr[-1] == pytest.approx(0.01, abs=1e-3)
