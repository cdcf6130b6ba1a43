"""The Muon optimizer in one process against torch.optim.Muon (Muon groups) and torch.optim.AdamW (AdamW groups):
square, tall and wide matrices, Nesterov or not, both lr adjustments, weight decay, bf16 and fp32 Newton-Schulz,
batched same-shape matrices, expert stacks, row splits, grad-less params, closures, errors and exact resume."""

import io

import pytest
import torch

from forge_lightning.optim.muon import Muon, SplitRows
from forge_lightning.optim.muon_exchange import LocalExchange, newton_schulz_flops

SHAPES = [
    (16, 16),
    (24, 8),
    (8, 24),
    (16, 16),
]  # square, tall, wide, and a second square to batch with the first
ADAMW_SHAPES = [(10,), (6, 5)]  # a norm and an embedding
STEPS = 4


def _tensors(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def _grads(shapes, step):
    return _tensors(shapes, 100 + step)


def _run(opt, params, shapes, steps, first=0):
    for step in range(first, first + steps):
        for p, g in zip(params, _grads(shapes, step), strict=True):
            p.grad = g.clone()
        opt.step()


def _fp32_zeropower(grad, ns_coefficients, ns_steps, eps):
    """A textbook fp32 quintic Newton-Schulz, the reference of ``ns_dtype=float32``."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_equals_torch_muon_and_adamw(nesterov, adjust_lr_fn, weight_decay, ns_dtype, monkeypatch):
    hyper = {"lr": 0.02, "momentum": 0.9, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}
    matrices, others = _tensors(SHAPES, 0), _tensors(ADAMW_SHAPES, 1)
    ours = [t.clone() for t in matrices + others]
    opt = Muon(
        [
            {"params": ours[: len(SHAPES)], "use_muon": True, "weight_decay": weight_decay},
            {"params": ours[len(SHAPES) :], "use_muon": False, "lr": 3e-3, "weight_decay": 0.05},
        ],
        ns_dtype=ns_dtype,
        betas=(0.8, 0.99),
        adam_eps=1e-6,
        **hyper,
    )
    _run(opt, ours, SHAPES + ADAMW_SHAPES, STEPS)

    if ns_dtype == torch.float32:
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _fp32_zeropower)
    ref_m, ref_a = [t.clone() for t in matrices], [t.clone() for t in others]
    ref_muon = torch.optim.Muon(ref_m, weight_decay=weight_decay, **hyper)
    ref_adamw = torch.optim.AdamW(ref_a, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    for step in range(STEPS):
        for p, g in zip(ref_m + ref_a, _grads(SHAPES + ADAMW_SHAPES, step), strict=True):
            p.grad = g.clone()
        ref_muon.step()
        ref_adamw.step()
    tol = 1e-6 if ns_dtype == torch.bfloat16 else 1e-5
    for got, want in zip(ours[: len(SHAPES)], ref_m, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
    for got, want in zip(ours[len(SHAPES) :], ref_a, strict=True):
        assert torch.equal(got, want)
    for p in ours[: len(SHAPES)]:
        assert set(opt.state[p]) == {"momentum_buffer"}
    for p in ours[len(SHAPES) :]:
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


def test_batched_same_shape_matrices_equal_each_alone():
    shapes = [(16, 16)] * 3
    together = _tensors(shapes, 0)
    opt = Muon([{"params": together, "use_muon": True}], lr=0.02, ns_dtype=torch.float32)
    _run(opt, together, shapes, STEPS)
    for i, want in enumerate(_tensors(shapes, 0)):
        alone = Muon([{"params": [want], "use_muon": True}], lr=0.02, ns_dtype=torch.float32)
        for step in range(STEPS):
            want.grad = _grads(shapes, step)[i]
            alone.step()
        torch.testing.assert_close(together[i], want, atol=1e-6, rtol=0)


def _torch_muon_on_slices(full, slices, steps, **hyper):
    """torch's Muon on each slice of ``full`` as its own 2-D param (grads sliced alike), reassembled by ``slices``."""
    pieces = [full[s].clone() for s in slices]
    ref = torch.optim.Muon(pieces, **hyper)
    for step in range(steps):
        grad = _grads([full.shape], step)[0]
        for piece, s in zip(pieces, slices, strict=True):
            piece.grad = grad[s].clone()
        ref.step()
    out = full.clone()
    for piece, s in zip(pieces, slices, strict=True):
        out[s] = piece
    return out


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_expert_stack_equals_torch_muon_per_expert(adjust_lr_fn):
    shape = (4, 12, 6)  # [E, m, n]
    (stack,) = _tensors([shape], 0)
    want = _torch_muon_on_slices(
        stack, [i for i in range(shape[0])], STEPS, lr=0.02, adjust_lr_fn=adjust_lr_fn
    )
    ours = [stack.clone()]
    opt = Muon([{"params": ours, "use_muon": True}], lr=0.02, adjust_lr_fn=adjust_lr_fn)
    _run(opt, ours, [shape], STEPS)
    torch.testing.assert_close(ours[0], want, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("shape", "sizes"),
    [
        ((16, 8), [8, 8]),  # gate_up [2I, D]: equal halves
        ((12, 4), [8, 4]),  # fused rows of other heights: original lr sqrt(2) and 1
        ((3, 10, 6), [5, 5]),  # HF MoE gate_up_proj [E, 2I, D]
    ],
)
def test_split_rows_equals_torch_muon_on_each_part(shape, sizes):
    (full,) = _tensors([shape], 0)
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    rows = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    slices = [(e, r) for e in range(shape[0]) for r in rows] if len(shape) == 3 else rows
    want = _torch_muon_on_slices(full, slices, STEPS, lr=0.02)
    ours = [full.clone()]
    opt = Muon([{"params": ours, "use_muon": True}], lr=0.02)
    opt.set_matrix_split(ours[0], SplitRows(sizes))
    _run(opt, ours, [shape], STEPS)
    torch.testing.assert_close(ours[0], want, atol=1e-6, rtol=0)


def test_exchange_builder_gets_params_and_costs_once():
    params = _tensors([(12, 4), (3, 4, 6), (5,)], 0)
    calls = []

    def builder(ps, costs):
        calls.append((list(ps), list(costs)))
        return LocalExchange(len(ps))

    opt = Muon(
        [{"params": params[:2], "use_muon": True}, {"params": params[2:], "use_muon": False}],
        shard_adamw_state=True,
    )
    opt.set_matrix_split(params[0], SplitRows([8, 4]))
    opt.set_exchange_builder(builder)
    _run(opt, params, [(12, 4), (3, 4, 6), (5,)], 2)
    assert len(calls) == 2
    (muon_params, muon_costs), (adamw_params, adamw_costs) = calls
    assert muon_params[0] is params[0] and muon_params[1] is params[1] and adamw_params[0] is params[2]
    assert muon_costs == [
        newton_schulz_flops((8, 4)) + newton_schulz_flops((4, 4)),
        newton_schulz_flops((3, 4, 6)),
    ]
    assert adamw_costs == [5.0]


def test_params_without_grad_are_skipped():
    params = _tensors([(6, 6), (6, 6), (4,)], 0)
    before = [p.clone() for p in params]
    opt = Muon([{"params": params[:2], "use_muon": True}, {"params": params[2:], "use_muon": False}], lr=0.02)
    params[0].grad = torch.ones(6, 6)
    opt.step()
    assert not torch.equal(params[0], before[0])
    assert torch.equal(params[1], before[1]) and torch.equal(params[2], before[2])
    assert params[1] not in opt.state and params[2] not in opt.state


def test_closure_runs_with_grad_and_its_loss_is_returned():
    w = torch.randn(6, 4, requires_grad=True)
    opt = Muon([{"params": [w], "use_muon": True}], lr=0.02)

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    before = w.detach().clone()
    loss = opt.step(closure)
    assert torch.equal(loss, (before**2).sum())
    assert not torch.equal(w.detach(), before)


def test_state_dict_round_trip_resumes_exactly():
    shapes = [*SHAPES, (3, 4, 6), *ADAMW_SHAPES]

    def make(params):
        opt = Muon(
            [
                {"params": params[:5], "use_muon": True, "param_names": [f"m{i}" for i in range(5)]},
                {"params": params[5:], "use_muon": False, "param_names": ["norm", "embed"], "lr": 3e-3},
            ],
            lr=0.02,
            adjust_lr_fn="match_rms_adamw",
        )
        opt.set_matrix_split(params[0], SplitRows([8, 8]))
        return opt

    straight = _tensors(shapes, 0)
    _run(make(straight), straight, shapes, 5)

    first = _tensors(shapes, 0)
    opt = make(first)
    _run(opt, first, shapes, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = [p.clone() for p in first]
    opt2 = make(resumed)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    _run(opt2, resumed, shapes, 2, first=3)
    for got, want in zip(resumed, straight, strict=True):
        assert torch.equal(got, want)


def test_scheduler_lr_changes_reach_the_step():
    (w,) = _tensors([(8, 8)], 0)
    opt = Muon([{"params": [w], "use_muon": True}], lr=0.02, weight_decay=0.0)
    w.grad = torch.ones(8, 8)
    opt.step()
    opt.param_groups[0]["lr"] = 0.0
    before = w.clone()
    opt.step()
    assert torch.equal(w, before)


@pytest.mark.parametrize(
    ("groups", "kwargs", "match"),
    [
        (
            [{"params": [torch.zeros(4)], "use_muon": True, "param_names": ["norm.weight"]}],
            {},
            "'norm.weight'.*AdamW",
        ),
        ([{"params": [torch.zeros(4, 4)]}], {}, "use_muon"),
        ([{"params": [torch.zeros(4, 4)], "use_muon": True}], {"momentum": 1.0}, "momentum"),
        ([{"params": [torch.zeros(4, 4)], "use_muon": True}], {"adjust_lr_fn": "x"}, "adjust_lr_fn"),
        ([{"params": [torch.zeros(4, 4)], "use_muon": True}], {"ns_steps": 0}, "ns_steps"),
        ([{"params": [torch.zeros(4, 4)], "use_muon": True}], {"ns_dtype": torch.int8}, "ns_dtype"),
        ([{"params": [torch.zeros(4)], "use_muon": False, "betas": (0.9, 1.0)}], {}, "betas"),
        ([{"params": [torch.zeros(4, 4)], "use_muon": True, "param_names": ["a", "b"]}], {}, "param_names"),
        ([{"params": [torch.zeros(4, 4)], "use_muon": True, "lr": -1.0}], {}, "lr"),
    ],
)
def test_bad_groups_and_options_are_refused(groups, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon(groups, **kwargs)


def test_bad_splits_are_refused():
    w, b = torch.zeros(8, 4), torch.zeros(4)
    opt = Muon([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}])
    with pytest.raises(ValueError, match="cuts 6 rows"):
        opt.set_matrix_split(w, SplitRows([3, 3]))
    with pytest.raises(ValueError, match="AdamW group"):
        opt.set_matrix_split(b, SplitRows([4]))
    with pytest.raises(ValueError, match="not a parameter"):
        opt.set_matrix_split(torch.zeros(8, 4), SplitRows([4, 4]))
    with pytest.raises(ValueError, match="positive integers"):
        SplitRows([4, 0])


def test_late_groups_and_builders_are_refused():
    w = torch.zeros(4, 4)
    opt = Muon([{"params": [w], "use_muon": True}])
    w.grad = torch.ones(4, 4)
    opt.step()
    with pytest.raises(ValueError, match="call add_param_group before it"):
        opt.add_param_group({"params": [torch.zeros(4, 4)], "use_muon": True})
    with pytest.raises(ValueError, match="call set_exchange_builder before it"):
        opt.set_exchange_builder(lambda ps, cs: LocalExchange(len(ps)))
    with pytest.raises(ValueError, match="call set_matrix_split before it"):
        opt.set_matrix_split(w, SplitRows([2, 2]))
    with pytest.raises(ValueError, match="call set_matrix_shape before it"):
        opt.set_matrix_shape(w, (8, 4))


class _ShardedLike(LocalExchange):
    replicated = False


def test_shard_adamw_state_needs_a_replicated_exchange():
    b = torch.zeros(4)
    opt = Muon([{"params": [b], "use_muon": False}], shard_adamw_state=True)
    opt.set_exchange_builder(lambda ps, cs: _ShardedLike(len(ps)))
    b.grad = torch.ones(4)
    with pytest.raises(ValueError, match="shard_adamw_state to false"):
        opt.step()


class _TwoEqualRowShards:
    """A tensor-parallel exchange in one process: the param is the top half of a ``[2 m, n]`` matrix whose other
    half (on a second, imaginary rank) always equals it."""

    replicated = False
    rank = 0
    owners = [0]

    def is_owner(self, index):
        return True

    def gather(self, local):
        return {0: torch.cat([local[0], local[0]])}

    def publish(self, results):
        return [results[0][: results[0].shape[0] // 2]]


def test_a_slice_uses_its_whole_matrix_shape():
    (half,) = _tensors([(8, 4)], 0)  # its [16, 4] matrix: original lr adjustment 2, not the slice's sqrt(2)
    full = torch.cat([half, half])
    ref = torch.optim.Muon([full], lr=0.02)
    ours = [half.clone()]
    opt = Muon([{"params": ours, "use_muon": True}], lr=0.02)
    opt.set_matrix_shape(ours[0], (16, 4))
    opt.set_exchange_builder(lambda ps, costs: _TwoEqualRowShards())
    for step in range(STEPS):
        grad = _grads([(8, 4)], step)[0]
        ours[0].grad = grad.clone()
        full.grad = torch.cat([grad, grad])
        opt.step()
        ref.step()
    torch.testing.assert_close(ours[0], full[:8], atol=1e-6, rtol=0)


def test_a_slice_without_its_whole_shape_is_refused():
    w = torch.zeros(8, 4)
    opt = Muon([{"params": [w], "use_muon": True}])
    opt.set_exchange_builder(lambda ps, costs: _TwoEqualRowShards())
    w.grad = torch.ones(8, 4)
    with pytest.raises(ValueError, match="set_matrix_shape"):
        opt.step()


def test_adamw_groups_equal_torch_foreach_adamw_over_mixed_dtypes():
    shapes = [(10,), (6, 5), (7,)]
    start = [
        t.to(d)
        for t, d in zip(_tensors(shapes, 0), [torch.float32, torch.bfloat16, torch.float32], strict=True)
    ]
    ours, ref = [t.clone() for t in start], [t.clone() for t in start]
    opt = Muon([{"params": ours, "use_muon": False, "lr": 3e-3, "weight_decay": 0.05}])
    torch_opt = torch.optim.AdamW(ref, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, foreach=True)
    for step in range(STEPS):
        for a, b, g in zip(ours, ref, _grads(shapes, step), strict=True):
            a.grad, b.grad = g.to(a.dtype), g.to(b.dtype)
        opt.step()
        torch_opt.step()
    for got, want in zip(ours, ref, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_loading_another_optimizers_state_is_refused():
    param = torch.nn.Parameter(torch.randn(4, 3))
    adamw = torch.optim.AdamW([param])
    param.grad = torch.ones_like(param)
    adamw.step()
    muon = Muon([{"params": [param], "use_muon": True}])
    with pytest.raises(ValueError, match="not Muon's"):
        muon.load_state_dict(adamw.state_dict())
