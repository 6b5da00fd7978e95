"""What a running deployment tells its operators: Prometheus series (`metrics`, through
ray.util.metrics), OpenTelemetry traces (`tracing`, no Ray) and `pdserve status` (`status`); the
moving averages replicas decide on (`averages`, no Ray)."""
