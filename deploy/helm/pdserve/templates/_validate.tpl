{{/*
Checks values.schema.json cannot make (it sees no derived values, nor a config given as text).
Each failure says what to change. pdserve's own checks run again when the app deploys;
`pdserve config validate FILE` explains every config error before you install.
*/}}
{{- define "pdserve.validate" -}}
{{- $name := include "pdserve.fullname" . -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "the RayService name %q must start with a letter and hold only a-z, 0-9 and '-' (a DNS-1035 label): set fullnameOverride" $name) -}}
{{- end -}}
{{- $config := include "pdserve.userConfig" . | fromYaml -}}
{{- $mode := get $config "mode" | default "disaggregated" -}}
{{- if not (has $mode (list "disaggregated" "colocated")) -}}
{{- fail (printf "config.mode %q: use disaggregated or colocated" $mode) -}}
{{- end -}}
{{- if eq $mode "disaggregated" -}}
{{- $prefill := include "pdserve.poolFacts" (dict "config" $config "pool" "prefill") | fromYaml -}}
{{- $decode := include "pdserve.poolFacts" (dict "config" $config "pool" "decode") | fromYaml -}}
{{- $p := int $prefill.tp -}}
{{- $d := int $decode.tp -}}
{{- if or (lt $d $p) (ne (mod $d $p) 0) -}}
{{- fail (printf "config: decode tensor_parallel_size %d with prefill tensor_parallel_size %d: each decode rank pulls its KV heads from one prefill rank, so set decode's to a multiple of prefill's (%d, %d, ...)" $d $p $p (mul 2 $p)) -}}
{{- end -}}
{{- end -}}
{{- $pools := include "pdserve.poolNames" . | splitList " " -}}
{{- $seen := dict -}}
{{- range $group := (include "pdserve.workerGroups" . | fromYaml).groups -}}
{{- if hasKey $seen $group.name -}}
{{- fail (printf "worker group name %q is used twice: give each extraWorkerGroups item its own name (prefill and decode are taken by the pools)" $group.name) -}}
{{- end -}}
{{- $_ := set $seen $group.name true -}}
{{- if not (has $group.pool $pools) -}}
{{- fail (printf "worker group %q is for pool %q, which config.mode %s does not run: use %s" $group.name $group.pool $mode (join " or " $pools)) -}}
{{- end -}}
{{- if gt (int $group.minReplicas) (int $group.maxReplicas) -}}
{{- fail (printf "worker group %q: minReplicas %d exceeds maxReplicas %d" $group.name (int $group.minReplicas) (int $group.maxReplicas)) -}}
{{- end -}}
{{- if or (lt (int $group.replicas) (int $group.minReplicas)) (gt (int $group.replicas) (int $group.maxReplicas)) -}}
{{- fail (printf "worker group %q: replicas %d must lie within minReplicas %d and maxReplicas %d" $group.name (int $group.replicas) (int $group.minReplicas) (int $group.maxReplicas)) -}}
{{- end -}}
{{- range $key := list "num-cpus" "num-gpus" "memory" "resources" -}}
{{- if hasKey $group.rayStartParams $key -}}
{{- fail (printf "worker group %q: rayStartParams.%s conflicts with the group's resources (pool tag); set cpu, gpus or customResources instead" $group.name $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with get (get $config "gateway" | default dict) "api_keys" -}}
{{- fail "config.gateway.api_keys: API keys given in the config would be rendered into the RayService's serveConfigV2 and shown on the Ray dashboard; put them in apiKeys.keys (the chart keeps them in a Secret) or apiKeys.existingSecret" -}}
{{- end -}}
{{- $egress := .Values.networkPolicy.egress -}}
{{- if and .Values.networkPolicy.enabled $egress.restrict .Values.autoscaler.enabled (not $egress.kubernetesApiCidrs) -}}
{{- fail "networkPolicy.egress.restrict cuts the autoscaler in the head off the Kubernetes API: set networkPolicy.egress.kubernetesApiCidrs to the API server's addresses (kubectl get endpoints kubernetes -n default), or autoscaler.enabled=false" -}}
{{- end -}}
{{- range $key := .Values.apiKeys.keys -}}
{{- if or (contains "," $key) (ne $key (trim $key)) (not $key) -}}
{{- fail "apiKeys.keys: a key must be non-empty, without commas or surrounding spaces (they travel comma-separated in PDSERVE_API_KEYS)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
