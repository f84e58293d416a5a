"""The outer loop in pure torch: Nesterov outer optimizer, pseudo-gradients, flat parameters, digests, inner AdamW."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from p2p_diloco.diloco.inner import make_inner_optimizer
from p2p_diloco.diloco.outer import (
    OuterOptimizer,
    assign_parameters_,
    flatten_parameters,
    pseudo_gradient,
    state_digest,
)

ATOL = 1e-6


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@pytest.fixture
def vectors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    theta0 = torch.randn(17, generator=generator)
    g1 = torch.randn(17, generator=generator)
    g2 = torch.randn(17, generator=generator)
    return theta0, g1, g2


# --- OuterOptimizer


def test_nesterov_two_steps_match_hand_computation(vectors):
    theta0, g1, g2 = vectors
    lr, mu = 0.7, 0.9
    outer = OuterOptimizer(theta0, lr=lr, momentum=mu)
    close(outer.momentum(), torch.zeros_like(theta0))

    # Step 1: m1 = g1; theta1 = theta0 - lr * (g1 + mu * m1)
    m1 = g1.clone()
    theta1 = theta0 - lr * (g1 + mu * m1)
    returned = outer.step(g1)
    close(returned, theta1)
    close(outer.anchor.data, theta1)
    close(outer.momentum(), m1)

    # Step 2: m2 = mu * m1 + g2; theta2 = theta1 - lr * (g2 + mu * m2)
    m2 = mu * m1 + g2
    theta2 = theta1 - lr * (g2 + mu * m2)
    outer.step(g2)
    close(outer.anchor.data, theta2)
    close(outer.momentum(), m2)


def test_zero_momentum_is_plain_sgd(vectors):
    theta0, g1, g2 = vectors
    lr = 0.7
    outer = OuterOptimizer(theta0, lr=lr, momentum=0.0)
    outer.step(g1)
    close(outer.anchor.data, theta0 - lr * g1)
    outer.step(g2)
    close(outer.anchor.data, theta0 - lr * g1 - lr * g2)
    close(outer.momentum(), torch.zeros_like(theta0))


def test_outer_optimizer_copies_its_inputs(vectors):
    theta0, g1, _ = vectors
    original = theta0.clone()
    outer = OuterOptimizer(theta0, lr=0.7, momentum=0.9)
    theta0.add_(100.0)  # the caller's tensor must not be the anchor
    close(outer.anchor.data, original)
    gradient = g1.clone()
    outer.step(gradient)
    gradient.add_(100.0)  # nor may the gradient alias the momentum buffer
    close(outer.momentum(), g1)


def test_step_accepts_other_dtype_and_shape(vectors):
    theta0, g1, _ = vectors
    outer = OuterOptimizer(theta0.half().float(), lr=0.5, momentum=0.0)
    outer.step(g1.half().reshape(1, -1))
    assert outer.anchor.dtype == torch.float32
    close(outer.anchor.data, theta0.half().float() - 0.5 * g1.half().float())


def test_load_replaces_anchor_and_momentum_and_next_step_continues(vectors):
    theta0, g1, g2 = vectors
    lr, mu = 0.7, 0.9
    outer = OuterOptimizer(theta0, lr=lr, momentum=mu)
    outer.step(g1)

    new_anchor = torch.linspace(-1, 1, theta0.numel())
    new_momentum = torch.linspace(2, 3, theta0.numel())
    outer.load(new_anchor, new_momentum)
    close(outer.anchor.data, new_anchor)
    close(outer.momentum(), new_momentum)

    m = mu * new_momentum + g2
    expected = new_anchor - lr * (g2 + mu * m)
    outer.step(g2)
    close(outer.anchor.data, expected)
    close(outer.momentum(), m)


def test_load_without_momentum_restarts_momentum(vectors):
    theta0, g1, g2 = vectors
    lr, mu = 0.7, 0.9
    outer = OuterOptimizer(theta0, lr=lr, momentum=mu)
    outer.step(g1)
    outer.load(theta0, None)
    close(outer.momentum(), torch.zeros_like(theta0))
    outer.step(g2)  # behaves like a first step: m = g2
    close(outer.momentum(), g2)
    close(outer.anchor.data, theta0 - lr * (g2 + mu * g2))


def test_load_copies_the_momentum(vectors):
    theta0, g1, g2 = vectors
    outer = OuterOptimizer(theta0, lr=0.7, momentum=0.9)
    momentum = g1.clone()
    outer.load(theta0, momentum)
    momentum.add_(100.0)
    close(outer.momentum(), g1)


def test_state_dict_round_trip(vectors):
    theta0, g1, g2 = vectors
    first = OuterOptimizer(theta0, lr=0.7, momentum=0.9)
    first.step(g1)
    first.step(g2)
    state = first.state_dict()
    assert set(state) == {"anchor", "momentum"}
    snapshot = {key: value.clone() for key, value in state.items()}

    second = OuterOptimizer(torch.zeros_like(theta0), lr=0.7, momentum=0.9)
    second.load(state["anchor"], state["momentum"])
    assert torch.equal(second.anchor.data, first.anchor.data)
    assert torch.equal(second.momentum(), first.momentum())

    g3 = g1 - g2
    first.step(g3)
    second.step(g3)
    assert torch.equal(second.anchor.data, first.anchor.data)
    assert torch.equal(second.momentum(), first.momentum())
    # The state dict holds copies: later steps leave it alone.
    assert torch.equal(state["anchor"], snapshot["anchor"])
    assert torch.equal(state["momentum"], snapshot["momentum"])
    assert not torch.equal(state["anchor"], first.anchor.data)


def test_state_dict_before_first_step_has_zero_momentum(vectors):
    theta0, _, _ = vectors
    state = OuterOptimizer(theta0).state_dict()
    close(state["anchor"], theta0)
    assert torch.equal(state["momentum"], torch.zeros_like(theta0))


# --- pseudo-gradients and a one-worker DiLoCo step


def test_pseudo_gradient_is_anchor_minus_local():
    anchor = torch.tensor([1.0, 2.0, -3.0])
    local = torch.tensor([0.5, 2.5, -3.0])
    assert torch.equal(pseudo_gradient(anchor, local), torch.tensor([0.5, -0.5, 0.0]))


def test_diloco_step_with_unit_lr_and_no_momentum_lands_on_local_weights():
    # Dyadic values keep every subtraction exact, so the anchor becomes exactly the local weights.
    anchor = torch.arange(-8, 8, dtype=torch.float32) / 8
    local = anchor + torch.tensor([0.25, -0.5] * 8)
    outer = OuterOptimizer(anchor, lr=1.0, momentum=0.0)
    outer.step(pseudo_gradient(outer.anchor.data, local))
    assert torch.equal(outer.anchor.data, local)


def test_diloco_step_moves_anchor_toward_local_weights():
    generator = torch.Generator().manual_seed(1)
    anchor = torch.randn(50, generator=generator)
    local = torch.randn(50, generator=generator)
    outer = OuterOptimizer(anchor, lr=0.5, momentum=0.0)
    outer.step(pseudo_gradient(anchor, local))
    close(outer.anchor.data, (anchor + local) / 2)
    assert (outer.anchor.data - local).norm() < (anchor - local).norm()


def test_diloco_round_trip_through_a_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    outer = OuterOptimizer(flatten_parameters(model.parameters()), lr=1.0, momentum=0.0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.125)  # "local training"
    local = flatten_parameters(model.parameters())
    assign_parameters_(model.parameters(), outer.step(pseudo_gradient(outer.anchor.data, local)))
    close(flatten_parameters(model.parameters()), local)


# --- flat parameters


def small_module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.LayerNorm(2))


def test_flatten_parameters_is_a_detached_fp32_copy_in_module_order():
    model = small_module()
    flat = flatten_parameters(model.parameters())
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert flat.dtype == torch.float32
    assert not flat.requires_grad
    assert torch.equal(flat, expected)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert torch.equal(flat, expected), "the flat copy must not alias the parameters"


def test_flatten_parameters_upcasts_half_precision():
    model = small_module().half()
    flat = flatten_parameters(model.parameters())
    assert flat.dtype == torch.float32
    assert torch.equal(flat, torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]))


def test_assign_parameters_round_trip():
    source, target = small_module(), small_module()
    with torch.no_grad():
        for parameter in target.parameters():
            parameter.fill_(7.0)
    flat = flatten_parameters(source.parameters())
    assign_parameters_(target.parameters(), flat)
    for a, b in zip(source.parameters(), target.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(flatten_parameters(target.parameters()), flat)


def test_assigned_parameters_do_not_alias_the_flat_vector():
    model = small_module()
    flat = torch.arange(sum(p.numel() for p in model.parameters()), dtype=torch.float32)
    snapshot = flat.clone()
    assign_parameters_(model.parameters(), flat)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-3.0).add_(1.0)
    assert torch.equal(flat, snapshot)
    flat.zero_()
    assert torch.equal(flatten_parameters(model.parameters()), snapshot * -3.0 + 1.0)


def test_assign_parameters_rejects_a_longer_vector():
    model = small_module()
    count = sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match=f"{count + 1} values"):
        assign_parameters_(model.parameters(), torch.zeros(count + 1))


def test_assign_parameters_rejects_a_shorter_vector():
    model = small_module()
    count = sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError):
        assign_parameters_(model.parameters(), torch.zeros(count - 1))


def test_assign_parameters_wrong_length_leaves_parameters_untouched():
    model = small_module()
    before = flatten_parameters(model.parameters())
    with pytest.raises(ValueError):
        assign_parameters_(model.parameters(), torch.zeros(before.numel() + 1))
    assert torch.equal(flatten_parameters(model.parameters()), before)


# --- state digest


def test_state_digest_equal_for_equal_tensors():
    a = torch.linspace(0, 1, 10)
    m = torch.linspace(-1, 0, 10)
    digest = state_digest(a, m)
    assert isinstance(digest, str) and len(digest) == 16
    assert state_digest(a.clone(), m.clone()) == digest
    transposed = a.reshape(2, 5).t()  # non-contiguous: hashed in its logical (row-major) order
    assert state_digest(transposed, m) == state_digest(transposed.contiguous(), m)


def test_state_digest_changes_with_one_ulp():
    a = torch.linspace(0, 1, 10)
    m = torch.linspace(-1, 0, 10)
    changed = a.clone()
    changed[3] = torch.nextafter(changed[3], torch.tensor(2.0))
    assert changed[3] != a[3]
    assert state_digest(changed, m) != state_digest(a, m)
    changed_m = m.clone()
    changed_m[-1] = torch.nextafter(changed_m[-1], torch.tensor(-2.0))
    assert state_digest(a, changed_m) != state_digest(a, m)


def test_state_digest_depends_on_argument_order():
    a, b = torch.zeros(4), torch.ones(4)
    assert state_digest(a, b) != state_digest(b, a)


# --- inner optimizer


def inner_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2, bias=False))


def test_inner_warmup_ramps_linearly():
    lr, warmup = 1e-2, 4
    optimizer, scheduler = make_inner_optimizer(inner_model(), lr=lr, weight_decay=0.1, warmup_steps=warmup)
    seen = []
    for _ in range(warmup + 3):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    expected = [min(1.0, (k + 1) / warmup) * lr for k in range(warmup + 3)]
    for lrs, want in zip(seen, expected):
        assert lrs == pytest.approx([want, want], rel=1e-12)
    # Linear: equal increments during warm-up, then flat at the base lr.
    increments = [seen[k + 1][0] - seen[k][0] for k in range(warmup - 1)]
    assert increments == pytest.approx([lr / warmup] * (warmup - 1))
    assert seen[-1][0] == pytest.approx(lr)


def test_inner_without_warmup_starts_at_full_lr():
    optimizer, _ = make_inner_optimizer(inner_model(), lr=3e-3, weight_decay=0.1, warmup_steps=0)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([3e-3, 3e-3])


def test_inner_weight_decay_skips_one_dimensional_parameters():
    model = inner_model()
    optimizer, _ = make_inner_optimizer(model, lr=1e-2, weight_decay=0.1, warmup_steps=1)
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert set(decay) == {id(p) for p in model.parameters()}, "every parameter is optimised exactly once"
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(list(model.parameters()))
    for name, parameter in model.named_parameters():
        if parameter.ndim < 2:
            assert decay[id(parameter)] == 0.0, name
        else:
            assert decay[id(parameter)] == 0.1, name
    assert any(p.ndim < 2 for p in model.parameters()) and any(p.ndim >= 2 for p in model.parameters())


def test_inner_step_with_zero_gradient_only_decays_matrices():
    model = inner_model()
    optimizer, _ = make_inner_optimizer(model, lr=1e-1, weight_decay=0.5, warmup_steps=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for name, parameter in model.named_parameters():
        if parameter.ndim < 2:
            assert torch.equal(parameter.detach(), before[name]), name
        else:
            torch.testing.assert_close(parameter.detach(), before[name] * (1 - 0.1 * 0.5))
