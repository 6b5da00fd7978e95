{{/*
Names and labels.

Object names are capped at 47 characters: KubeRay names a RayService's cluster <name>-<5 chars>
and that cluster's Services <cluster>-serve-svc, which must stay within 63.
*/}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels that never change between releases: selectors and Ray pod templates use only these. */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of top-level objects (not of Ray pods: KubeRay fingerprints their templates). */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
The pdserve config from the values: a map, or YAML text (`--set-file config=FILE`). Rendered as
YAML; callers read it back with fromYaml (a fresh copy every time, so .Values is never changed).
A config with problems fails the render with the report `pdserve config validate` would print
(_config_check.tpl): every template that reads the config reads it here.
*/}}
{{- define "pdserve.userConfig" -}}
{{- if not (hasKey . "pdserveUserConfig") -}}
{{- $config := .Values.config | default dict -}}
{{- if kindIs "string" $config -}}
{{- $config = fromYaml $config -}}
{{- if hasKey $config "Error" -}}
{{- fail (printf "config: 1 problem\n  (config): not valid YAML, or not a mapping of pdserve config fields (%s)\n      check the file with `pdserve config validate FILE`" (get $config "Error")) -}}
{{- end -}}
{{- end -}}
{{- with include "pdserve.configReport" (dict "root" . "config" $config) -}}{{- fail . -}}{{- end -}}
{{- /* Kept in the root context: one check per render, not one per caller. */ -}}
{{- $_ := set . "pdserveUserConfig" (toYaml $config) -}}
{{- end -}}
{{- get . "pdserveUserConfig" -}}
{{- end -}}

{{/* The pools that run, in the order of their worker groups: colocated mode has one (decode = Unified). */}}
{{- define "pdserve.poolNames" -}}
{{- $config := include "pdserve.userConfig" . | fromYaml -}}
{{- if eq (get $config "mode" | default "disaggregated") "colocated" -}}decode{{- else -}}prefill decode{{- end -}}
{{- end -}}

{{/* Selector of the release's Ray pods (head and workers of every cluster KubeRay runs for it,
   the old and the new one during an upgrade): labels the chart writes into the pod templates. */}}
{{- define "pdserve.rayPodSelector" -}}
matchLabels:
  {{- include "pdserve.selectorLabels" . | nindent 2 }}
matchExpressions:
  - {key: app.kubernetes.io/component, operator: In, values: [ray-head, ray-worker]}
{{- end -}}

{{- define "pdserve.redisSelector" -}}
matchLabels:
  {{- include "pdserve.selectorLabels" . | nindent 2 }}
  app.kubernetes.io/component: redis
{{- end -}}

{{/* Whether the routers need Redis' password ("true" or empty): the bundled Redis with auth, or an
   external one whose password is in auth.existingSecret. */}}
{{- define "pdserve.redisAuth" -}}
{{- if and (include "pdserve.redisUrl" .) .Values.redis.auth.enabled -}}
{{- if or .Values.redis.auth.existingSecret (not .Values.redis.externalUrl) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* The Redis URL handed to the routers: external, bundled, or none (then the config's own). */}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.externalUrl -}}
{{- .Values.redis.externalUrl -}}
{{- else if .Values.redis.enabled -}}
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "pdserve.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/*
What one replica of a pool needs, read from the config with ServeConfig's defaults: a pool's
engine fields override the top-level engine's; ray_actor_options default to {num_cpus: 1};
a tensor-parallel replica is a gang of `tp` ranks, each with the replica's ray_actor_options.
Input: dict "config" (the user config) "pool" (prefill or decode).
*/}}
{{- define "pdserve.poolFacts" -}}
{{- $pool := get .config .pool | default dict -}}
{{- $engine := merge (deepCopy (get $pool "engine" | default dict)) (get .config "engine" | default dict) -}}
{{- $tp := int (get $engine "tensor_parallel_size" | default 1) -}}
{{- $options := dict "num_cpus" 1 -}}
{{- if hasKey $pool "ray_actor_options" -}}{{- $options = get $pool "ray_actor_options" | default dict -}}{{- end -}}
{{- $numCpus := 1.0 -}}
{{- if hasKey $options "num_cpus" -}}{{- $numCpus = float64 (get $options "num_cpus") -}}{{- end -}}
{{- $numGpus := float64 (get $options "num_gpus" | default 0) -}}
{{- $replicas := int (get $pool "num_replicas" | default 1) -}}
{{- $min := $replicas -}}
{{- $max := $replicas -}}
{{- $autoscaling := get $pool "autoscaling" -}}
{{- if $autoscaling -}}
{{- $min = hasKey $autoscaling "min_replicas" | ternary (int (get $autoscaling "min_replicas")) 1 -}}
{{- $max = hasKey $autoscaling "max_replicas" | ternary (int (get $autoscaling "max_replicas")) 4 -}}
{{- $replicas = min (max $replicas $min) $max -}}
{{- end -}}
tp: {{ $tp }}
cpus: {{ mulf $numCpus $tp | ceil | int }}
gpus: {{ mulf $numGpus $tp | ceil | int }}
acceleratorType: {{ get $options "accelerator_type" | default "" | quote }}
replicas: {{ $replicas }}
minReplicas: {{ $min }}
maxReplicas: {{ $max }}
{{- end -}}

{{/*
The config the cluster runs: the user's, plus what Kubernetes needs (values.yaml, top).
Everything else is left as written, so `pdserve serve-config` prints the same Serve config for it.
*/}}
{{- define "pdserve.config" -}}
{{- $config := include "pdserve.userConfig" . | fromYaml -}}
{{- $gateway := get $config "gateway" | default dict -}}
{{- $_ := set $gateway "host" "0.0.0.0" -}}
{{- $_ := set $gateway "port" (int .Values.ports.http) -}}
{{- $_ := set $config "gateway" $gateway -}}
{{- $redisUrl := include "pdserve.redisUrl" . -}}
{{- if $redisUrl -}}
{{- $router := get $config "router" | default dict -}}
{{- $_ := set $router "redis_url" $redisUrl -}}
{{- $_ := set $config "router" $router -}}
{{- end -}}
{{- range $name := include "pdserve.poolNames" . | splitList " " -}}
{{- $pool := get $config $name | default dict -}}
{{- $options := dict "num_cpus" 1 -}}
{{- if hasKey $pool "ray_actor_options" -}}{{- $options = get $pool "ray_actor_options" | default dict -}}{{- end -}}
{{- $resources := get $options "resources" | default dict -}}
{{- /* A small share of the pool tag: the tag says where, GPUs and CPUs say how many fit. */ -}}
{{- $_ := set $resources (printf "pdserve_%s" $name) 0.001 -}}
{{- $_ := set $options "resources" $resources -}}
{{- $_ := set $pool "ray_actor_options" $options -}}
{{- $_ := set $config $name $pool -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* The Ray Serve config (serveConfigV2): what app.serve_config returns for pdserve.config, plus gRPC. */}}
{{- define "pdserve.serveConfig" -}}
{{- $config := include "pdserve.config" . | fromYaml -}}
{{- $app := dict "name" (get $config "name" | default "pdserve") "route_prefix" "/" "import_path" "pdserve.app:build_app" "args" $config -}}
{{- $prefillScaling := get (get $config "prefill" | default dict) "autoscaling" -}}
{{- $decodeScaling := get (get $config "decode" | default dict) "autoscaling" -}}
{{- if and (kindIs "map" (get $config "slo")) (eq (get $config "mode" | default "disaggregated") "disaggregated") (kindIs "map" $prefillScaling) (kindIs "map" $decodeScaling) -}}
{{- $_ := set $app "autoscaling_policy" (include "pdserve.jointSloPolicy" $config | fromYaml) -}}
{{- else if get $config "pool_ratio" -}}
{{- $_ := set $app "autoscaling_policy" (include "pdserve.poolRatioPolicy" (dict "config" $config "ratio" (get $config "pool_ratio")) | fromYaml) -}}
{{- end -}}
{{- $serve := dict "proxy_location" "EveryNode" "http_options" (dict "host" $config.gateway.host "port" $config.gateway.port) "applications" (list $app) -}}
{{- if .Values.grpc.enabled -}}
{{- $_ := set $serve "grpc_options" (dict "port" (int .Values.ports.grpc) "grpc_servicer_functions" (list "pdserve.gateway.pdserve_pb2_grpc.add_GenerationServicer_to_server")) -}}
{{- end -}}
{{- toYaml $serve -}}
{{- end -}}

{{/*
The application-level policy that keeps prefill:decode replicas within config.pool_ratio, as
app.serve_config writes it (the defaults are AutoscalingSpec's and PoolRatio's; tests/helm checks
both stay equal). Input: dict "config" "ratio".
*/}}
{{- define "pdserve.poolRatioPolicy" -}}
{{- $prefill := get (get .config "prefill" | default dict) "autoscaling" | default dict -}}
{{- $decode := get (get .config "decode" | default dict) "autoscaling" | default dict -}}
policy_function: pdserve.autoscale.policies:PoolRatioPolicy
policy_kwargs:
  prefill:
    target_queued_tokens: {{ get $prefill "target_queued_prefill_tokens" | default 4096 }}
    target_ongoing_requests: {{ get $prefill "target_ongoing_requests" | default 8 }}
  decode:
    target_running_sequences: {{ get $decode "target_running_sequences" | default 32 }}
    target_kv_usage: {{ get $decode "target_kv_usage" | default 0.7 }}
  min_ratio: {{ get .ratio "min_prefill_per_decode" | default 0.25 }}
  max_ratio: {{ get .ratio "max_prefill_per_decode" | default 4.0 }}
{{- end -}}

{{/*
The application-level policy that sizes both pools against config.slo (both pools autoscaling,
disaggregated), as app.serve_config writes it (the defaults are SLOConfig's, AutoscalingSpec's and
EngineConfig's; tests/helm checks both stay equal). Input: the config.
*/}}
{{- define "pdserve.jointSloPolicy" -}}
{{- $slo := get . "slo" -}}
{{- $prefill := get (get . "prefill") "autoscaling" -}}
{{- $decode := get (get . "decode") "autoscaling" -}}
{{- $engine := merge (deepCopy (get (get . "decode") "engine" | default dict)) (get . "engine" | default dict) -}}
policy_function: pdserve.autoscale.policies:JointSloPolicy
policy_kwargs:
  ttft_ms: {{ get $slo "ttft_ms" | default 2000.0 | float64 }}
  itl_ms: {{ get $slo "itl_ms" | default 100.0 | float64 }}
  percentile: {{ get $slo "percentile" | default 99.0 | float64 }}
  max_total_replicas: {{ get . "max_total_replicas" | default (add (get $prefill "max_replicas" | default 4) (get $decode "max_replicas" | default 4)) | int }}
  downscale_delay_s: {{ maxf (get $prefill "downscale_delay_s" | default 60.0 | float64) (get $decode "downscale_delay_s" | default 60.0 | float64) }}
  max_num_seqs: {{ get $engine "max_num_seqs" | default 64 | int }}
{{- end -}}

{{/*
One worker group's settings: a pool's facts, overridden by its values (`pools.<pool>` or an item
of extraWorkerGroups). Input: dict "root" "name" "pool" "facts" "spec" "extra".
*/}}
{{- define "pdserve.group" -}}
{{- $root := .root -}}
{{- $spec := .spec -}}
{{- $facts := .facts -}}
{{- $accelerator := $facts.acceleratorType -}}
{{- if .extra -}}{{- $accelerator = $spec.acceleratorType | default $accelerator -}}{{- end -}}
{{- $known := dict -}}
{{- if $accelerator -}}{{- $known = get $root.Values.accelerators $accelerator | default dict -}}{{- end -}}
{{- $gpus := $facts.gpus -}}
{{- if not (kindIs "invalid" $spec.gpus) -}}{{- $gpus = int $spec.gpus -}}{{- end -}}
{{- $vendor := $spec.gpuVendor | default $known.vendor | default "nvidia" -}}
{{- $replicas := .extra | ternary 0 $facts.replicas -}}
{{- $min := .extra | ternary 0 $facts.minReplicas -}}
{{- $max := $facts.maxReplicas -}}
{{- if not (kindIs "invalid" $spec.replicas) -}}{{- $replicas = int $spec.replicas -}}{{- end -}}
{{- if not (kindIs "invalid" $spec.minReplicas) -}}{{- $min = int $spec.minReplicas -}}{{- end -}}
{{- if not (kindIs "invalid" $spec.maxReplicas) -}}{{- $max = int $spec.maxReplicas -}}{{- end -}}
{{- $resources := dict (printf "pdserve_%s" .pool) "1" -}}
{{- if kindIs "invalid" $spec.cpu -}}
{{- /* Ray is told the replica's CPUs only, so one replica fills one pod; the pod has one core more. */ -}}
{{- $_ := set $resources "CPU" (toString $facts.cpus) -}}
{{- end -}}
{{- if $accelerator -}}{{- $_ := set $resources (printf "accelerator_type:%s" $accelerator) "1" -}}{{- end -}}
{{- range $key, $value := $spec.customResources | default dict -}}{{- $_ := set $resources $key (toString $value) -}}{{- end -}}
name: {{ .name }}
pool: {{ .pool }}
replicas: {{ $replicas }}
minReplicas: {{ $min }}
maxReplicas: {{ $max }}
cpu: {{ kindIs "invalid" $spec.cpu | ternary (add1 $facts.cpus) $spec.cpu | toString | quote }}
memory: {{ $spec.memory | default (eq (int $gpus) 0 | ternary "4Gi" (printf "%dGi" (mul $gpus $root.Values.memoryPerGpuGi))) | quote }}
gpus: {{ $gpus }}
gpuResource: {{ eq $vendor "amd" | ternary "amd.com/gpu" "nvidia.com/gpu" }}
resources: {{- toYaml $resources | nindent 2 }}
nodeSelector: {{- merge (deepCopy ($spec.nodeSelector | default dict)) ($known.nodeSelector | default dict) | toYaml | nindent 2 }}
tolerations: {{- $spec.tolerations | default list | toYaml | nindent 2 }}
affinity: {{- $spec.affinity | default dict | toYaml | nindent 2 }}
rayStartParams: {{- $spec.rayStartParams | default dict | toYaml | nindent 2 }}
labels: {{- $spec.labels | default dict | toYaml | nindent 2 }}
annotations: {{- $spec.annotations | default dict | toYaml | nindent 2 }}
rdma: {{ $spec.rdma | default false }}
{{- end -}}

{{/* Every worker group, in their fixed order: the pools' (prefill, decode), then extraWorkerGroups. */}}
{{- define "pdserve.workerGroups" -}}
{{- $root := . -}}
{{- $config := include "pdserve.userConfig" . | fromYaml -}}
{{- $groups := list -}}
{{- range $pool := include "pdserve.poolNames" . | splitList " " -}}
{{- $facts := include "pdserve.poolFacts" (dict "config" $config "pool" $pool) | fromYaml -}}
{{- $spec := get $root.Values.pools $pool | default dict -}}
{{- $groups = append $groups (include "pdserve.group" (dict "root" $root "name" $pool "pool" $pool "facts" $facts "spec" $spec "extra" false) | fromYaml) -}}
{{- end -}}
{{- range $spec := .Values.extraWorkerGroups -}}
{{- $facts := include "pdserve.poolFacts" (dict "config" $config "pool" $spec.pool) | fromYaml -}}
{{- $groups = append $groups (include "pdserve.group" (dict "root" $root "name" $spec.name "pool" $spec.pool "facts" $facts "spec" $spec "extra" true) | fromYaml) -}}
{{- end -}}
{{- toYaml (dict "groups" $groups) -}}
{{- end -}}

{{/* Environment of every Ray container: Ray's worker niceness (unless null), the transport limits
   `pdserve serve` sets (launch.ray_env: gRPC messages up to gateway.max_body_bytes, HAProxy's
   client timeout at gateway.request_timeout_s; the defaults are GatewayConfig's, and tests/helm
   checks they stay equal), the API keys and Redis' password (when set, from their Secrets), and
   the values' env (last: a variable set there wins). */}}
{{- define "pdserve.rayEnv" -}}
{{- $config := include "pdserve.userConfig" . | fromYaml }}
{{- $gateway := get $config "gateway" | default dict }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ get $gateway "max_body_bytes" | default 4194304 | int | quote }}
- name: RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S
  value: {{ get $gateway "request_timeout_s" | default 600 | float64 | ceil | int | quote }}
{{- if not (kindIs "invalid" .Values.rayWorkerNiceness) }}
- name: RAY_worker_niceness
  value: {{ .Values.rayWorkerNiceness | quote }}
{{- end }}
{{- if or .Values.apiKeys.keys .Values.apiKeys.existingSecret }}
- name: PDSERVE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "pdserve.fullname" .)) }}
      key: {{ .Values.apiKeys.secretKey }}
{{- end }}
{{- if include "pdserve.redisAuth" . }}
- name: {{ get (get $config "router" | default dict) "redis_password_env" | default "PDSERVE_REDIS_PASSWORD" }}
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level settings every Ray pod shares. Only the head calls the Kubernetes API (KubeRay's
   autoscaler runs beside it): no other pod gets a service-account token. Input: dict "root" "head". */}}
{{- define "pdserve.rayPodSpec" -}}
{{- $root := .root -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: {{ and .head $root.Values.autoscaler.enabled }}
{{- with $root.Values.podSecurityContext }}
securityContext: {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: dshm
    emptyDir:
      medium: Memory
      {{- with $root.Values.sharedMemorySize }}
      sizeLimit: {{ . }}
      {{- end }}
  - {name: tmp, emptyDir: {}}
  - {name: cache, emptyDir: {}}
{{- with $root.Values.volumes }}
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* What a Ray container writes, on a read-only root: /tmp (Ray's session directory, HAProxy's
   files, compilers' temporaries) and the caches, the image's model under ~/.cache/pdserve kept. */}}
{{- define "pdserve.writableMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: cache, mountPath: /home/ray/.cache/pdserve/kernels, subPath: pdserve-kernels}
- {name: cache, mountPath: /home/ray/.cache/huggingface, subPath: huggingface}
- {name: cache, mountPath: /home/ray/.triton, subPath: triton}
{{- end -}}

{{/* A Ray container's securityContext: the values', plus IPC_LOCK for a pool on RDMA.
   Input: dict "root" "rdma". */}}
{{- define "pdserve.raySecurityContext" -}}
{{- $context := deepCopy (.root.Values.securityContext | default dict) -}}
{{- if .rdma -}}
{{- $capabilities := get $context "capabilities" | default dict -}}
{{- $_ := set $capabilities "add" (append (get $capabilities "add" | default list) "IPC_LOCK" | uniq) -}}
{{- $_ := set $context "capabilities" $capabilities -}}
{{- end -}}
{{- toYaml $context -}}
{{- end -}}

{{/* Container-level settings every Ray container shares. Input: dict "root" "rdma". */}}
{{- define "pdserve.rayContainer" -}}
{{- $root := .root -}}
image: {{ include "pdserve.image" $root }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
{{- $env := include "pdserve.rayEnv" $root }}
{{- if $env }}
env: {{- $env | trim | nindent 2 }}
{{- end }}
{{- $context := include "pdserve.raySecurityContext" . | fromYaml }}
{{- with $context }}
securityContext: {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  - name: dshm
    mountPath: /dev/shm
  {{- include "pdserve.writableMounts" . | nindent 2 }}
{{- with $root.Values.volumeMounts }}
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The Redis container's start: the password (when there is one) into a config file that only
   the redis user reads, then redis-server with the values' args ("$@"). Redis' config syntax
   takes a double-quoted string with \" and \\ escaped. */}}
{{- define "pdserve.redisStart" -}}
umask 077
{{- if include "pdserve.redisAuth" . }}
printf 'requirepass "%s"\n' "$(sed 's/[\\"]/\\&/g' /run/pdserve/redis-password/password)" > /run/pdserve/redis-config/redis.conf
{{- else }}
: > /run/pdserve/redis-config/redis.conf
{{- end }}
exec redis-server /run/pdserve/redis-config/redis.conf "$@"
{{- end -}}

{{- define "pdserve.redisPing" -}}
{{- if include "pdserve.redisAuth" . -}}
REDISCLI_AUTH="$(cat /run/pdserve/redis-password/password)" redis-cli ping | grep -q PONG
{{- else -}}
redis-cli ping | grep -q PONG
{{- end -}}
{{- end -}}
