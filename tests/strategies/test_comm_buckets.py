"""FP8 error feedback follows the parameters when DDP rebuilds its gradient buckets (it does after the first step:
bucket 0 then holds other parameters than before)."""

import torch
from torch import nn

from forge_lightning.strategies.comm.fp8_allreduce import fp8_all_reduce_
from forge_lightning.strategies.comm.hooks import CommHookState, _fp8_reduce_


class _Bucket:
    """The part of ``dist.GradBucket`` the hooks read."""

    def __init__(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        self._params, self._grads = params, grads

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def index(self) -> int:
        return 0


def test_residuals_are_kept_per_parameter_across_bucket_rebuilds(one_process_group):
    g = torch.Generator().manual_seed(0)
    a, b = nn.Parameter(torch.zeros(1000)), nn.Parameter(torch.zeros(3000))
    state = CommHookState(error_feedback=True, block=256)
    step1 = torch.randn(1000, generator=g)
    _fp8_reduce_(state, _Bucket([a], [step1.clone()]))  # before the rebuild: bucket 0 = [a]
    residual_a = state.residuals[id(a)].clone()
    assert residual_a.abs().max() > 0  # FP8 rounds: some error to feed back

    grads = [torch.randn(1000, generator=g), torch.randn(3000, generator=g)]
    reduced = [t.clone() for t in grads]
    _fp8_reduce_(state, _Bucket([a, b], reduced))  # after it: bucket 0 = [a, b]
    expected = torch.cat(grads)
    expected_residual = torch.cat([residual_a, torch.zeros(3000)])
    fp8_all_reduce_(expected, block=256, residual=expected_residual)
    torch.testing.assert_close(torch.cat(reduced), expected, atol=0, rtol=0)
    torch.testing.assert_close(state.residuals[id(a)], expected_residual[:1000], atol=0, rtol=0)
    torch.testing.assert_close(state.residuals[id(b)], expected_residual[1000:], atol=0, rtol=0)
