#!/bin/bash
# A chart pod's view of the machine, run as PID 1 of fresh mount, PID and network namespaces
# (unshare): the root filesystem read-only, tmpfs only where the chart mounts emptyDirs
# ($WRITABLE), Ray started with token auth as KubeRay starts it, the chart's serveConfigV2 deployed
# through the dashboard as the operator deploys it. Prints one "step: result" line per check;
# everything dies with the namespace.
set -u
ip link set lo up
# $KEEP: paths under a writable mount that must stay visible (a checkout under /tmp, where the
# test's pdserve comes from; in the image it is in site-packages): bound back after the tmpfs.
mkdir -p /run/pdserve-sandbox && mount --rbind / /run/pdserve-sandbox
mount -o remount,bind,ro / || { echo "sandbox: cannot remount / read-only"; exit 90; }
for dir in $WRITABLE; do mount -t tmpfs tmpfs "$dir"; done
for path in ${KEEP:-}; do
  mkdir -p "$path" && mount --bind "/run/pdserve-sandbox$path" "$path" && mount -o remount,bind,ro "$path"
done
touch /usr/.pdserve-probe 2>/dev/null && { echo "sandbox: root still writable"; exit 91; }
echo "sandbox: ready"
ray start --head --num-cpus 3 --dashboard-host 127.0.0.1 --disable-usage-stats \
    --resources '{"pdserve_prefill": 1, "pdserve_decode": 1}' > /tmp/ray-start.log 2>&1 \
    || { cat /tmp/ray-start.log; echo "ray: failed"; exit 92; }
echo "ray: started"
# The dashboard comes up after `ray start` returns; KubeRay retries until it answers, so do we.
for _ in $(seq 1 120); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8265/api/version)" != "000" ] && break
  sleep 1
done
serve deploy -a http://127.0.0.1:8265 "$SERVE_CONFIG" > /tmp/deploy.log 2>&1 || { cat /tmp/deploy.log; exit 93; }
for _ in $(seq 1 150); do
  curl -sf http://127.0.0.1:8000/v1/models > /dev/null && break
  sleep 1
done
echo "completion: $(curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "tiny-llama-seed0", "prompt": "Hello", "max_tokens": 4}')"
pdserve status > /tmp/status.log 2>&1
echo "status with token: rc=$?"
cat /tmp/status.log
echo "dashboard without token: $(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8265/api/serve/applications/)"
RAY_AUTH_TOKEN= timeout 60 pdserve status > /tmp/noauth.log 2>&1
echo "status without token: rc=$?"
grep -h "RAY_AUTH_TOKEN" /tmp/noauth.log | tail -1
