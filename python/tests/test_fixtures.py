"""The committed fixtures, made by transformers + PEFT, reproduced through the Python API for
every model family, on the CPU backend and on wgpu (lavapipe in CI)."""

from __future__ import annotations

import pytest

from conftest import FAMILIES, batch, errors, expected, open_engine


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "device, rel_tol",
    [
        # rel. Frobenius 1e-5 on the CPU, 1e-4 on wgpu (its summation order); max abs 1e-4 on
        # both: the bounds the Rust tests hold the same fixtures to.
        ("cpu", 1e-5),
        ("gpu", 1e-4),
    ],
)
def test_batch_reproduces_transformers_and_peft(family: str, device: str, rel_tol: float):
    engine = open_engine(family, device)
    requests = batch(family)["requests"]
    want = expected(family)
    results = engine.encode(requests, with_tower=True)
    assert [r.id for r in results] == [r["id"] for r in requests]
    assert len({r.step for r in results}) == 1, "the batch mixes its adapters in one step"
    for request, result in zip(requests, results):
        assert result.adapter == request["adapter"]
        for part in ("embeds", "tower", "deepstack"):
            key = f"{request['id']}.{part}"
            actual = getattr(result, part)
            if key not in want:
                assert actual is None, f"{key}: the model has no {part}"
                continue
            rel, worst = errors(actual, want[key])
            assert rel <= rel_tol and worst <= 1e-4, f"{key}: rel {rel:e}, max {worst:e}"
