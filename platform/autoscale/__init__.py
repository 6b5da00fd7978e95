"""Queue-depth autoscaling for Ray Serve (DESIGN.md section 3): one policy per pool
(`pdserve.autoscale.policies`), fed by what each replica reports."""


def autoscaling_stats(stats: dict) -> dict[str, float]:
    """The figures a replica reports for its pool's policy (Ray Serve's `record_autoscaling_stats`)."""
    return {"queued_prefill_tokens": float(stats["queued_prefill_tokens"]), "num_running": float(stats["num_running"]),
            "kv_usage": stats["kv_usage"]}
