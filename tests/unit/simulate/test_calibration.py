"""The cpu profile's fit: steps timed from a known additive roofline give back its rates (the
measuring half runs the real engine: `pdserve simulate calibrate`)."""

import pytest

from pdserve.simulate.calibration import fit, predict
from pdserve.simulate.roofline import prefill_pairs
from tests.unit.simulate.fixtures import MODEL


def test_the_fit_recovers_a_known_roofline():
    samples = [{"num_tokens": n, "kv_tokens": n, "pairs": prefill_pairs(0, n), "seconds": 0.0}
               for n in (32, 128, 512, 1024)]
    samples += [{"num_tokens": b, "kv_tokens": b * c, "pairs": b * c, "seconds": 0.0}
                for b, c in ((1, 128), (8, 128), (32, 1024))]
    truth = (2e10, 3e11, 5e9)
    for s, t in zip(samples, predict(MODEL, samples, *truth)):
        s["seconds"] = t
    assert fit(MODEL, samples) == pytest.approx(truth, rel=1e-6)


def test_an_additive_profile_sums_what_a_gpu_overlaps():
    from pdserve.simulate.hardware import Accelerator
    from pdserve.simulate.roofline import StepCost

    cpu = Accelerator("cpu", 1e10, 1e11, 1e9, 1e9, 1e10, attention_bytes_per_s=5e9, is_additive=True)
    # 2e9 weight bytes / 1e10 + 8 x 2e9 FLOPs / 1e11 (+ 8,000 pairs' attention) + 8,000 x 65,536 / 5e9.
    expected = 0.2 + (8 * 2e9 + 8000 * 4 * 32 * 32 * 128) / 1e11 + 8000 * 65536 / 5e9
    assert StepCost(MODEL, cpu).seconds(8, 8000, 8000) == pytest.approx(expected, rel=1e-12)
