"""AUC, normalized entropy and calibration on hand-computed cases."""

import math

import pytest
import torch

from gem_ops.metrics.quality import binary_quality, flat_metrics, quality_report


def logit(p):
    return torch.log(torch.tensor(p) / (1 - torch.tensor(p)))


def test_auc_counts_ties_as_half():
    # positive at 2 vs negatives at 0, 1, 2: two wins and one tie of three pairs.
    q = binary_quality(torch.tensor([0.0, 1.0, 2.0, 2.0]), torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert q["auc"] == pytest.approx(2.5 / 3, abs=1e-6)


def test_base_rate_predictor_has_ne_one_and_calibration_one():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    q = binary_quality(logit([0.25] * 4), labels)
    assert q["ne"] == pytest.approx(1.0, abs=1e-6)
    assert q["calibration"] == pytest.approx(1.0, abs=1e-6)
    assert q["auc"] == pytest.approx(0.5)


def test_better_predictions_lower_ne_and_overprediction_shows_in_calibration():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    good = binary_quality(logit([0.7, 0.1, 0.1, 0.1]), labels)
    assert good["ne"] < 1.0 and good["auc"] == 1.0
    high = binary_quality(logit([0.5] * 4), labels)
    assert high["calibration"] == pytest.approx(2.0)


def test_auc_standard_error_matches_the_bootstrap():
    """DeLong's standard error against the spread of the AUC over bootstrap resamples of the same examples, on a
    large sample and on a tenth of it (a few positives)."""
    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(3000, generator=g) < 0.05).double()
    logits = labels + torch.randn(3000, generator=g, dtype=torch.float64)  # informative: AUC near 0.78
    for n in (3000, 300):
        q = binary_quality(logits[:n], labels[:n])
        boot = []
        for _ in range(400):
            i = torch.randint(0, n, (n,), generator=g)
            boot.append(binary_quality(logits[i], labels[i])["auc"])
        assert q["positives"] == labels[:n].sum().item()
        assert q["auc_stderr"] == pytest.approx(torch.tensor(boot).std().item(), rel=0.15), n
    few = binary_quality(logits[:150], labels[:150])  # under ten positives: no error estimate, the count says it
    assert few["positives"] < 10 and math.isnan(few["auc_stderr"]) and not math.isnan(few["auc"])


def test_undefined_metrics_are_nan():
    q = binary_quality(torch.tensor([0.1, 0.2]), torch.tensor([0.0, 0.0]))
    assert math.isnan(q["auc"]) and math.isnan(q["ne"]) and math.isnan(q["calibration"])
    assert math.isnan(q["auc_stderr"]) and q["positives"] == 0
    assert binary_quality(torch.tensor([]), torch.tensor([]))["count"] == 0


def test_report_per_domain_and_task_respects_label_masks():
    logits = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [1.0, 0.0], [-1.0, 0.0]])
    labels = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, True], [True, False], [True, False]])
    report = quality_report(logits, labels, mask, torch.tensor([0, 0, 1, 1]), ["feed", "reels"],
                            ["click", "conversion"])
    assert set(report) == {"all/click", "feed/click", "reels/click", "all/conversion", "feed/conversion"}
    assert report["all/click"]["count"] == 4 and report["all/conversion"]["count"] == 2
    assert report["feed/click"]["auc"] == 1.0
    flat = flat_metrics(report)
    assert flat["eval.reels.click.auc"] == 1.0
    assert not any(math.isnan(v) for v in flat.values())


def test_calibration_stderr_is_the_spread_of_calibration_over_label_draws():
    # A model whose predictions are exact: its calibration on a day varies only with the day's draws.
    generator = torch.Generator().manual_seed(0)
    q = torch.rand(2000, generator=generator) * 0.2 + 0.02
    draws = [binary_quality(logit(q.tolist()), torch.bernoulli(q, generator=generator)) for _ in range(400)]
    calibrations = torch.tensor([d["calibration"] for d in draws])
    stderr = torch.tensor([d["calibration_stderr"] for d in draws])
    assert calibrations.std().item() == pytest.approx(stderr.mean().item(), rel=0.15)
    assert 0.04 < stderr.mean().item() < 0.08  # ~240 positives: several times the 0.95-1.05 band's half-width
    assert math.isnan(binary_quality(logit([0.1, 0.2]), torch.tensor([0.0, 0.0]))["calibration_stderr"])
