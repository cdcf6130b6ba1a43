"""Success rate with its Wilson interval, mean return / length with a normal interval."""

from __future__ import annotations

import pytest

from forge_lightning.sim.metrics import EpisodeRecord, mean_interval, summarize, wilson_interval


@pytest.mark.parametrize(
    ("successes", "trials", "low", "high"),
    [
        # Wilson (1927) score interval at 95% (z = 1.959964), as published tables and statsmodels give it
        (8, 10, 0.490162, 0.943318),
        (0, 10, 0.0, 0.277533),
        (10, 10, 0.722467, 1.0),
        (50, 100, 0.403832, 0.596168),
        (1, 3, 0.061492, 0.792340),
    ],
)
def test_wilson_interval_matches_reference_values(successes, trials, low, high):
    assert wilson_interval(successes, trials) == pytest.approx((low, high), abs=1e-6)


def test_wilson_interval_narrows_with_more_episodes_and_lower_confidence():
    wide, narrow = wilson_interval(5, 10), wilson_interval(50, 100)
    assert wide[1] - wide[0] > narrow[1] - narrow[0]
    ninety = wilson_interval(50, 100, confidence=0.9)
    assert ninety[1] - ninety[0] < narrow[1] - narrow[0]


@pytest.mark.parametrize(
    ("args", "match"), [((3, 2), "successes"), ((0, 0), "trials"), ((1, 2, 1.5), "confidence")]
)
def test_wilson_interval_refuses_impossible_counts(args, match):
    with pytest.raises(ValueError, match=match):
        wilson_interval(*args)


def test_mean_interval_and_summary():
    mean, low, high = mean_interval([1.0, 2.0, 3.0, 4.0])
    # sample std 1.290994, half-width 1.959964 * 1.290994 / 2
    assert (mean, low, high) == pytest.approx((2.5, 2.5 - 1.265151, 2.5 + 1.265151), abs=1e-6)
    assert mean_interval([3.0]) == (3.0, 3.0, 3.0)
    records = [
        EpisodeRecord(index=i, seed=i, success=i < 8, reward=float(i), length=10 + i) for i in range(10)
    ]
    summary = summarize(records)
    assert summary["episodes"] == 10
    assert summary["success_rate"] == 0.8
    assert (summary["success_ci_low"], summary["success_ci_high"]) == pytest.approx(
        (0.490162, 0.943318), abs=1e-6
    )
    assert summary["mean_reward"] == 4.5 and summary["mean_length"] == 14.5
    assert summary["reward_ci_low"] < 4.5 < summary["reward_ci_high"]
