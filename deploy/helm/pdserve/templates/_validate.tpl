{{/*
Checks of the values that values.schema.json cannot make (it sees no derived values). Each failure
says what to change. The config itself is checked where it is read (pdserve.userConfig), every
problem at once, as `pdserve config validate FILE` checks it before you install.
*/}}
{{- define "pdserve.validate" -}}
{{- $name := include "pdserve.fullname" . -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "the RayService name %q must start with a letter and hold only a-z, 0-9 and '-' (a DNS-1035 label): set fullnameOverride" $name) -}}
{{- end -}}
{{- $config := include "pdserve.userConfig" . | fromYaml -}}{{- /* fails with the config's problems, if any */ -}}
{{- $mode := get $config "mode" | default "disaggregated" -}}
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
