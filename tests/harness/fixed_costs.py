"""A decode replica with the latency target and placement rates a test sets."""

from pdserve.decode.placement import CostModel, Rates, Target
from pdserve.decode.server import DecodeServer


class FixedCosts(CostModel):
    """A cost model whose rates the test sets and that learns nothing: a placement test's decisions
    are then the ones it works out, whatever this machine's speed (the learning is
    tests/unit/decode/test_placement.py's)."""

    def __init__(self, **rates: float):
        super().__init__()
        self.fixed = Rates(**{**vars(super().rates()), **rates})

    def step(self, *_) -> None:
        pass

    def remote_prefill(self, *_) -> None:
        pass

    def pull(self, *_) -> None:
        pass

    def first_token(self, *_) -> None:
        pass

    def rates(self) -> Rates:
        return self.fixed


def fix_costs(decode: DecodeServer, ttft_s: float, itl_s: float = 0.1, **rates: float) -> None:
    """Give `decode` this latency target and these rates (the priors' for the rest)."""
    decode.target = Target(ttft_s, itl_s)
    decode.costs = FixedCosts(**rates)
    decode.engine.engine.on_step = None


def prefill_here(decode: DecodeServer) -> None:
    """Have `decode` prefill every prompt itself: the prefill pool would miss a 1 s TTFT target by
    far (a token a second), a prompt of under a thousand tokens meets it here."""
    fix_costs(decode, ttft_s=1.0, remote_tokens_per_s=1.0)


# A latency target the prefill pool meets on any machine (an hour to the first token): an app
# configured with it prefills every prompt remotely, as tests of the remote path need.
REMOTE_PREFILL_SLO = {"ttft_ms": 3_600_000}
