"""The cpu profile's fit: steps timed from a known roofline give back its bandwidth, FLOP/s and
overhead (the measuring half runs the real engine: `pdserve simulate calibrate`)."""

import pytest

from pdserve.simulate.calibration import fit, predict
from pdserve.simulate.roofline import prefill_pairs
from tests.unit.simulate.fixtures import MODEL


def test_the_fit_recovers_a_known_roofline():
    samples = [{"num_tokens": n, "kv_tokens": n, "pairs": prefill_pairs(0, n), "seconds": 0.0}
               for n in (32, 128, 512, 1024)]
    samples += [{"num_tokens": b, "kv_tokens": b * c, "pairs": b * c, "seconds": 0.0}
                for b, c in ((1, 128), (8, 128), (32, 1024))]
    truth = (2e10, 3e11, 4e-3)
    for s, t in zip(samples, predict(MODEL, samples, *truth)):
        s["seconds"] = t
    bw, peak, overhead = fit(MODEL, samples)
    assert bw == pytest.approx(truth[0], rel=0.02)
    assert peak == pytest.approx(truth[1], rel=0.02)
    assert overhead == pytest.approx(truth[2], rel=0.05)
