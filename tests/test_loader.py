import pytest
import torch
from torch.utils.data import Dataset

from forge_lightning.datamodules.loader import ShardedLoader, StepLoader


class _Samples(Dataset):
    """Sample i has input_ids = [i, i] and labels with i % 3 tokens ignored."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = torch.tensor([i, i, i])
        labels[: i % 3] = -100
        return {"input_ids": torch.tensor([i, i, i]), "labels": labels}


def _ids(batches):
    return [b["input_ids"][:, 0].tolist() for b in batches]


def test_same_samples_per_step_for_any_layout():
    data = _Samples(50)
    one = list(StepLoader(data, batch_size=4, accumulate=2, seed=3))
    ranks = [
        list(StepLoader(data, batch_size=2, num_replicas=2, rank=r, accumulate=2, seed=3)) for r in (0, 1)
    ]
    small = list(StepLoader(data, batch_size=2, accumulate=4, seed=3))
    # 50 samples hold 6 whole steps of 8 samples (the tail is dropped): 12, 12 and 24 micro-batches.
    assert len(one) == 12 and len(ranks[0]) == len(ranks[1]) == 12 and len(small) == 24
    for step in range(6):
        ref = sorted(sum(_ids(one[2 * step : 2 * step + 2]), []))
        dp = sorted(
            sum(_ids(ranks[0][2 * step : 2 * step + 2]) + _ids(ranks[1][2 * step : 2 * step + 2]), [])
        )
        acc = sorted(sum(_ids(small[4 * step : 4 * step + 4]), []))
        assert ref == dp == acc


def test_step_tokens_count_the_whole_step():
    data = _Samples(16)
    batches = list(StepLoader(data, batch_size=2, accumulate=2, shuffle=False))
    for step in range(len(batches) // 2):
        group = batches[2 * step : 2 * step + 2]
        expected = sum(int((b["labels"] != -100).sum()) for b in group)
        assert all(int(b["step_tokens"]) == expected for b in group)


def test_resume_continues_exactly_and_rolls_epochs():
    data = _Samples(20)
    full = StepLoader(data, batch_size=2, accumulate=1, seed=5)
    epoch0 = _ids(iter(full))
    for _ in range(len(full)):
        full.mark_consumed()
    epoch1 = _ids(iter(full))
    assert epoch0 != epoch1 and sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) == list(range(20))

    run = StepLoader(data, batch_size=2, accumulate=1, seed=5)
    for _ in range(4):
        run.mark_consumed()
    resumed = StepLoader(data, batch_size=2, accumulate=1, seed=5)
    resumed.load_state_dict(run.state_dict())
    assert _ids(iter(resumed)) == epoch0[4:]


def test_resume_refuses_a_different_global_batch():
    state = StepLoader(_Samples(20), batch_size=2, seed=5).state_dict()
    other = StepLoader(_Samples(20), batch_size=4, seed=5)
    with pytest.raises(ValueError, match="global_batch=2 but this run has global_batch=4"):
        other.load_state_dict(state)


def test_too_small_dataset_is_refused():
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        StepLoader(_Samples(3), batch_size=2, num_replicas=2, rank=0)


def test_sharded_loader_covers_without_duplicates():
    data = _Samples(11)
    seen = [sum(_ids(ShardedLoader(data, batch_size=3, num_replicas=2, rank=r)), []) for r in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 5
    assert sorted(seen[0] + seen[1]) == list(range(10))
