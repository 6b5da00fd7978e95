"""The Ray shell an engine replica (Prefill, Decode or Unified) runs in, whatever its role:
`engine_replica.EngineReplica` answers Ray Serve (stats for routers, the autoscaler and
`pdserve status`, metrics, health checks, shutdown); `rank_workers` places and watches the rank
workers of a tensor-parallel replica. The role itself lives in `prefill/` and `decode/`.
"""
