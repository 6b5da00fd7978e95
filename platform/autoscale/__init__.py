"""Autoscaling for Ray Serve (DESIGN.md section 3): one queue-depth policy per pool, or the joint
P:D policy against the latency target (`pdserve.autoscale.policies`, its core in
`pdserve.autoscale.joint`), fed by what each replica reports."""

# Figures a replica reports when its engine measures them (the joint policy reads them).
OPTIONAL_STATS = ("prefill_tokens_per_s", "prompt_tokens_per_s", "prompts_per_s", "ttft_attainment", "itl_attainment",
                  "requests_per_s", "residence_s", "num_in_flight_requests", "kv_read_share")


def autoscaling_stats(stats: dict) -> dict[str, float]:
    """The figures a replica reports for its pool's policy (Ray Serve's `record_autoscaling_stats`)."""
    return {"queued_prefill_tokens": float(stats["queued_prefill_tokens"]), "num_running": float(stats["num_running"]),
            "kv_usage": stats["kv_usage"], "num_waiting": float(stats["num_waiting"]),
            **{k: float(stats[k]) for k in OPTIONAL_STATS if stats.get(k) is not None}}
