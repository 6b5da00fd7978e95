"""The lab cluster's driver (tests/harness/ray_lab.py): `python -m tests.harness.ray_driver ADDRESS`,
then one JSON command per stdin line, one JSON reply per stdout line ({"result": ...} or
{"error": "..."}). Commands: deploy {config, http_port}, delete {app}, stats {app, pool} (one
replica's, the handle's pick), replica_stats {app, pool, num_calls, timeout_s} (several calls at
once: {"stats": a list, a pool's replicas each answering one or more, a test keys them by "pid";
"errors": the calls' that did not answer})."""

from __future__ import annotations

import json
import sys
import time
import traceback


def main(address: str) -> None:
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    from pdserve.app import build
    from pdserve.config import ServeConfig

    ray.init(address=address, log_to_driver=False, logging_level="error")
    out = sys.stdout
    sys.stdout = sys.stderr  # replies only on the real stdout

    def deploy(config: dict, http_port: int) -> None:
        serve.start(http_options={"host": "0.0.0.0", "port": http_port})
        cfg = ServeConfig.model_validate(config)
        serve.run(build(cfg), name=cfg.name, route_prefix="/", blocking=False)

    def delete(app: str) -> None:
        serve.delete(app)  # returns once Serve has stopped the app's replicas (and freed their CPUs)
        # This process's handles are cached by app and deployment name: the next app of the same
        # name would get them, with request routers made from the deleted app's config.
        _get_global_client().shutdown_cached_handles()

    def stats(app: str, pool: str) -> dict:
        # CI twice saw the first call through a new app's handle time out at 30 s (the replicas
        # answered the HTTP requests meanwhile): a call that does not answer is cancelled, and the
        # next attempt goes through a new handle, as `replica_stats` does.
        for attempt in range(3):
            response = serve.get_deployment_handle(pool, app).stats.remote()
            try:
                return response.result(timeout_s=30)
            except TimeoutError:
                response.cancel()
                if attempt == 2:
                    raise
                _get_global_client().shutdown_cached_handles()

    def replica_stats(app: str, pool: str, num_calls: int = 8, timeout_s: float = 10) -> dict:
        # Calls in flight at once: the handle's router counts them against the replica it sent
        # them to and picks the least loaded one for the next, so they spread over the replicas
        # (one call at a time would go to the same replica each time). All of them within
        # `timeout_s`: a caller polls again rather than wait out each call's own timeout.
        handle = serve.get_deployment_handle(pool, app)
        responses = [handle.stats.remote() for _ in range(num_calls)]
        deadline = time.monotonic() + timeout_s
        answers, errors = [], []
        for response in responses:
            try:
                answers.append(response.result(timeout_s=max(0.01, deadline - time.monotonic())))
            except Exception as e:  # noqa: BLE001 - a replica that just died: the others still answer
                response.cancel()
                errors.append(f"{type(e).__name__}: {str(e)[:200]}")
        if not answers:
            # CI once saw every call of a round time out (and the next round's too) on a handle made
            # just after the previous app of the same name was deleted: the next round gets a new
            # handle, and the caller sees the errors and Serve's view of the app.
            _get_global_client().shutdown_cached_handles()
            errors.append(f"status: {serve.status().applications.get(app)}")
        return {"stats": answers, "errors": errors}

    ops = {"deploy": deploy, "delete": delete, "stats": stats, "replica_stats": replica_stats}
    for line in sys.stdin:
        command = json.loads(line)
        try:
            reply = {"result": ops[command.pop("op")](**command)}
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            reply = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
        out.write(json.dumps(reply, default=str) + "\n")
        out.flush()
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
