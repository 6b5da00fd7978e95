{{/*
The pdserve config checked when the chart renders, as `pdserve config validate` checks it: every
problem at once, each at its field path with what is wrong and what the field is for, whether
`config` is a map or YAML text. Fields, types, bounds and descriptions come from
files/config.schema.json (generated from platform/config.py); the checks across fields are
ServeConfig's, restated at the end with its messages (tests/helm compares the chart's report with
config_check's on the same configs). As in pydantic, a model's checks across fields run once its
own fields are fine, and ServeConfig's own once everything else is.
*/}}

{{/* The report `pdserve.userConfig` fails with, or nothing. Input: dict "root" "config" (parsed). */}}
{{- define "pdserve.configReport" -}}
{{- $schema := .root.Files.Get "files/config.schema.json" | fromJson -}}
{{- $lines := include "pdserve.check.value" (dict "value" .config "node" $schema "path" "" "defs" $schema.definitions "doc" "" "model" "ServeConfig") -}}
{{- $problems := list -}}
{{- range splitList "\n" $lines -}}{{- if . -}}{{- $problems = append $problems (fromJson .) -}}{{- end -}}{{- end -}}
{{- $across := include "pdserve.check.across" (dict "config" .config "schema" $schema "problems" $problems) -}}
{{- range splitList "\n" $across -}}{{- if . -}}{{- $problems = append $problems (fromJson .) -}}{{- end -}}{{- end -}}
{{- if $problems -}}
config: {{ len $problems }} problem{{ if gt (len $problems) 1 }}s{{ end }}
{{- range $problems }}
  {{ .path | default "(config)" }}: {{ .message }}
{{- if .hint }}
      {{ .hint }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* One problem, as a line of JSON. Input: dict "path" "message" "hint". */}}
{{- define "pdserve.check.problem" -}}
{{ toJson . }}
{{ end -}}

{{/*
The problems of one value against its schema node, one JSON line each. Input: dict "value" "node"
"path" "defs" "doc" (the first paragraph of the holding model's description: the hint of a field
without one; "" outside models) "model" (a model's name when node is a field holding one).
*/}}
{{- define "pdserve.check.value" -}}
{{- $node := .node -}}
{{- $value := .value -}}
{{- $hint := get $node "description" | default .doc -}}
{{- $model := .model -}}
{{- $nullable := false -}}
{{- with get $node "anyOf" -}}{{- /* `X | None`: the null branch, and the other */ -}}
{{- range . -}}
{{- if eq (toString (get . "type")) "null" -}}{{- $nullable = true -}}{{- else -}}{{- $node = . -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- with get $node "$ref" -}}
{{- $model = trimPrefix "#/definitions/" . -}}
{{- $node = get $.defs $model -}}
{{- end -}}
{{- $types := get $node "type" | default list -}}
{{- if kindIs "string" $types -}}{{- $types = list $types -}}{{- end -}}
{{- if has "null" $types -}}{{- $nullable = true -}}{{- end -}}
{{- $type := without $types "null" | first | default "" -}}
{{- if and (hasKey $node "properties") (not $type) -}}{{- $type = "object" -}}{{- end -}}
{{- $invalid := get (dict "integer" "Input should be a valid integer" "number" "Input should be a valid number" "string" "Input should be a valid string" "boolean" "Input should be a valid boolean" "array" "Input should be a valid list" "object" "Input should be a valid dictionary") $type -}}
{{- if eq (toString (get $node "additionalProperties")) "false" -}}{{- $invalid = printf "Input should be a valid dictionary or instance of %s" $model -}}{{- end -}}
{{- $message := "" -}}
{{- $number := 0.0 -}}
{{- $isNumber := has (kindOf $value) (list "int" "int64" "float64") -}}
{{- $isBool := kindIs "bool" $value -}}
{{- if kindIs "invalid" $value -}}
{{- if not $nullable -}}{{- $message = $invalid -}}{{- end -}}
{{- else if has $type (list "integer" "number") -}}
{{- if or $isNumber $isBool -}}
{{- $number = float64 $value -}}
{{- if and (eq $type "integer") (ne (floor $number) $number) -}}{{- $message = "Input should be a valid integer, got a number with a fractional part" -}}{{- end -}}
{{- else if and (kindIs "string" $value) (eq $type "integer") -}}
{{- if regexMatch "^\\s*[-+]?[0-9]+\\s*$" $value -}}{{- $number = float64 (trim $value) -}}{{- else -}}{{- $message = "Input should be a valid integer, unable to parse string as an integer" -}}{{- end -}}
{{- else if kindIs "string" $value -}}
{{- if regexMatch "^\\s*[-+]?([0-9]+\\.?[0-9]*|\\.[0-9]+)([eE][-+]?[0-9]+)?\\s*$" $value -}}{{- $number = float64 (trim $value) -}}{{- else -}}{{- $message = "Input should be a valid number, unable to parse string as a number" -}}{{- end -}}
{{- else -}}
{{- $message = $invalid -}}
{{- end -}}
{{- else if eq $type "boolean" -}}
{{- if kindIs "string" $value -}}
{{- if not (has (lower $value) (list "0" "off" "f" "false" "n" "no" "1" "on" "t" "true" "y" "yes")) -}}{{- $message = "Input should be a valid boolean, unable to interpret input" -}}{{- end -}}
{{- else if $isNumber -}}
{{- if not (has (float64 $value) (list 0.0 1.0)) -}}{{- $message = "Input should be a valid boolean, unable to interpret input" -}}{{- end -}}
{{- else if not $isBool -}}
{{- $message = $invalid -}}
{{- end -}}
{{- else if $type -}}
{{- if not (kindIs (get (dict "string" "string" "array" "slice" "object" "map") $type) $value) -}}{{- $message = $invalid -}}{{- end -}}
{{- end -}}
{{- $got := "" -}}
{{- if kindIs "string" $value -}}{{- $got = printf "'%s'" $value -}}
{{- else if kindIs "bool" $value -}}{{- $got = ternary "True" "False" $value -}}
{{- else if $isNumber -}}{{- $got = include "pdserve.check.number" (float64 $value) -}}
{{- end -}}
{{- if and (not $message) (not (kindIs "invalid" $value)) -}}
{{- /* The value has its type: its bounds and pattern. */ -}}
{{- if has $type (list "integer" "number") -}}
{{- if and (hasKey $node "minimum") (lt $number (get $node "minimum")) -}}
{{- $message = printf "Input should be greater than or equal to %s" (include "pdserve.check.number" (get $node "minimum")) -}}
{{- else if and (hasKey $node "exclusiveMinimum") (le $number (get $node "exclusiveMinimum")) -}}
{{- $message = printf "Input should be greater than %s" (include "pdserve.check.number" (get $node "exclusiveMinimum")) -}}
{{- else if and (hasKey $node "maximum") (gt $number (get $node "maximum")) -}}
{{- $message = printf "Input should be less than or equal to %s" (include "pdserve.check.number" (get $node "maximum")) -}}
{{- else if and (hasKey $node "exclusiveMaximum") (ge $number (get $node "exclusiveMaximum")) -}}
{{- $message = printf "Input should be less than %s" (include "pdserve.check.number" (get $node "exclusiveMaximum")) -}}
{{- end -}}
{{- end -}}
{{- with get $node "pattern" -}}
{{- if not (regexMatch . $value) -}}{{- $message = printf "String should match pattern '%s'" . -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- $enum := get $node "enum" -}}
{{- if hasKey $node "const" -}}{{- $enum = list (get $node "const") -}}{{- end -}}
{{- if and $enum (not (and (kindIs "invalid" $value) $nullable)) (not (has $value $enum)) -}}
{{- /* A choice: anything else, of any type, is reported as not one of them. */ -}}
{{- $choices := list -}}
{{- range $enum -}}{{- $choices = append $choices (kindIs "string" . | ternary (printf "'%v'" .) (toString .)) -}}{{- end -}}
{{- $message = printf "Input should be %s" (last $choices) -}}
{{- if gt (len $choices) 1 -}}{{- $message = printf "Input should be %s or %s" (initial $choices | join ", ") (last $choices) -}}{{- end -}}
{{- end -}}
{{- if $message -}}
{{- include "pdserve.check.problem" (dict "path" .path "message" (cat $message (ternary (printf "(got %s)" $got) "" (ne $got "")) | trim) "hint" $hint) -}}
{{- else if kindIs "map" $value -}}
{{- /* A mapping: its fields, each against its own schema; unknown fields where the model is closed. */ -}}
{{- $properties := get $node "properties" | default dict -}}
{{- $extra := get $node "additionalProperties" -}}
{{- $doc := "" -}}
{{- if hasKey $node "properties" -}}{{- $doc = regexReplaceAll "\\s+" (get $node "description" | default "" | splitList "\n\n" | first) " " | trim -}}{{- end -}}
{{- range $key, $item := $value -}}
{{- $path := $key -}}{{- if $.path -}}{{- $path = printf "%s.%s" $.path $key -}}{{- end -}}
{{- if hasKey $properties $key -}}
{{- include "pdserve.check.value" (dict "value" $item "node" (get $properties $key) "path" $path "defs" $.defs "doc" $doc "model" "") -}}
{{- else if hasKey (get $node "x-removed" | default dict) $key -}}
{{- include "pdserve.check.problem" (dict "path" $path "message" (get (get $node "x-removed") $key) "hint" "") -}}
{{- else if eq (toString $extra) "false" -}}
{{- include "pdserve.check.problem" (dict "path" $path "message" (printf "unknown field '%s'" $key) "hint" (printf "fields here: %s" (keys $properties | sortAlpha | join ", "))) -}}
{{- else if kindIs "map" $extra -}}
{{- include "pdserve.check.value" (dict "value" $item "node" $extra "path" $path "defs" $.defs "doc" "" "model" "") -}}
{{- end -}}
{{- end -}}
{{- else if and (kindIs "slice" $value) (hasKey $node "items") -}}
{{- range $i, $item := $value -}}
{{- include "pdserve.check.value" (dict "value" $item "node" (get $node "items") "path" (printf "%s.%d" $.path $i) "defs" $.defs "doc" "" "model" "") -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A number as Python prints it in these messages: whole ones without a fraction. */}}
{{- define "pdserve.check.number" -}}
{{- if eq (floor .) (float64 .) -}}{{- printf "%d" (int64 .) -}}{{- else -}}{{- toString . -}}{{- end -}}
{{- end -}}

{{/*
ServeConfig's checks across fields (platform/config.py), each where pydantic runs it: a model's own
once its fields are fine; a pool's merged engine (the top-level engine's fields under the pool's)
once the top-level engine and the pool are fine; ServeConfig's once nothing else is wrong. Then
the chart's own rule. Input: dict "config" "schema" "problems" (the fields' problems).
*/}}
{{- define "pdserve.check.across" -}}
{{- $config := .config -}}
{{- $defs := .schema.definitions -}}
{{- $broken := dict -}}{{- /* every path that holds a problem, and every path above one */ -}}
{{- range .problems -}}{{- include "pdserve.check.mark" (dict "broken" $broken "path" .path) -}}{{- end -}}
{{- $pool := $defs.PoolConfig.properties -}}
{{- $scaling := $defs.AutoscalingSpec.properties -}}
{{- $engine := $defs.EngineConfig.properties -}}
{{- $out := "" -}}
{{- with get $config "router" -}}
{{- if and (kindIs "map" .) (kindIs "string" (get . "redis_url")) (not (hasKey $broken "router.redis_url")) -}}
{{- $netloc := regexReplaceAll "^[^:/?#]*://" (regexFind "^[^:/?#]*://[^/?#]*" (get . "redis_url")) "" -}}
{{- if and (contains "@" $netloc) (regexMatch "[^:]" (splitList "@" $netloc | initial | join "@")) -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" "router.redis_url" "message" "redis_url carries credentials, which would be written into the Serve config in plain text: put the password in the environment variable redis_password_env names instead" "hint" $defs.RouterConfig.properties.redis_url.description)) -}}
{{- $_ := set $broken "router" true -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $name := list "prefill" "decode" -}}
{{- $spec := get $config $name -}}
{{- if not (kindIs "map" $spec) -}}{{- $spec = dict -}}{{- end -}}
{{- $autoscaling := get $spec "autoscaling" -}}
{{- if and (kindIs "map" $autoscaling) (not (hasKey $broken (printf "%s.autoscaling" $name))) -}}
{{- $min := float64 (hasKey $autoscaling "min_replicas" | ternary (get $autoscaling "min_replicas") $scaling.min_replicas.default) -}}
{{- $max := float64 (hasKey $autoscaling "max_replicas" | ternary (get $autoscaling "max_replicas") $scaling.max_replicas.default) -}}
{{- $toZero := include "pdserve.check.true" (hasKey $autoscaling "scale_to_zero" | ternary (get $autoscaling "scale_to_zero") $scaling.scale_to_zero.default) -}}
{{- $message := "" -}}
{{- if gt $min $max -}}
{{- $message = printf "min_replicas %d exceeds max_replicas %d" (int64 $min) (int64 $max) -}}
{{- else if and (eq $min 0.0) (not $toZero) -}}
{{- $message = "min_replicas 0 scales the pool to zero: set scale_to_zero: true to allow it" -}}
{{- end -}}
{{- if $message -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" (printf "%s.autoscaling" $name) "message" $message "hint" $pool.autoscaling.description)) -}}
{{- include "pdserve.check.mark" (dict "broken" $broken "path" (printf "%s.autoscaling" $name)) -}}
{{- end -}}
{{- end -}}
{{- if not (or (hasKey $broken "engine") (hasKey $broken $name)) -}}
{{- $merged := merge (deepCopy (get $spec "engine" | default dict)) (get $config "engine" | default dict) -}}
{{- $seqs := float64 (hasKey $merged "max_num_seqs" | ternary (get $merged "max_num_seqs") $engine.max_num_seqs.default) -}}
{{- $tokens := float64 (hasKey $merged "max_num_batched_tokens" | ternary (get $merged "max_num_batched_tokens") $engine.max_num_batched_tokens.default) -}}
{{- if lt $tokens $seqs -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" (printf "%s.engine" $name) "message" (printf "max_num_batched_tokens (%d) must be at least max_num_seqs (%d) so every running sequence can decode" (int64 $tokens) (int64 $seqs)) "hint" $pool.engine.description)) -}}
{{- include "pdserve.check.mark" (dict "broken" $broken "path" (printf "%s.engine" $name)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $ratio := get $config "pool_ratio" -}}
{{- if and (kindIs "map" $ratio) (not (hasKey $broken "pool_ratio")) -}}
{{- $band := $defs.PoolRatio.properties -}}
{{- $min := float64 (hasKey $ratio "min_prefill_per_decode" | ternary (get $ratio "min_prefill_per_decode") $band.min_prefill_per_decode.default) -}}
{{- $max := float64 (hasKey $ratio "max_prefill_per_decode" | ternary (get $ratio "max_prefill_per_decode") $band.max_prefill_per_decode.default) -}}
{{- if gt $min $max -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" "pool_ratio" "message" (printf "min_prefill_per_decode %s exceeds max_prefill_per_decode %s" (include "pdserve.check.float" $min) (include "pdserve.check.float" $max)) "hint" $.schema.properties.pool_ratio.description)) -}}
{{- include "pdserve.check.mark" (dict "broken" $broken "path" "pool_ratio") -}}
{{- end -}}
{{- end -}}
{{- if not $broken -}}
{{- /* ServeConfig's own checks: every field is fine. */ -}}
{{- $mode := get $config "mode" | default "disaggregated" -}}
{{- $tp := dict -}}
{{- range $name := list "prefill" "decode" -}}
{{- $merged := merge (deepCopy (get (get $config $name | default dict) "engine" | default dict)) (get $config "engine" | default dict) -}}
{{- $_ := set $tp $name (get $merged "tensor_parallel_size" | default $engine.tensor_parallel_size.default | int) -}}
{{- end -}}
{{- if and (eq $mode "disaggregated") (or (lt $tp.decode $tp.prefill) (ne (mod $tp.decode $tp.prefill) 0)) -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" "" "message" (printf "prefill tensor_parallel_size %d with decode tensor_parallel_size %d: each decode rank pulls its KV heads from one prefill rank, so the decode degree must be a multiple of the prefill degree (equal, or k times it)" $tp.prefill $tp.decode) "hint" "")) -}}
{{- end -}}
{{- $set := dict -}}{{- /* the fields written and not null */ -}}
{{- range $key, $value := $config -}}{{- if not (kindIs "invalid" $value) -}}{{- $_ := set $set $key true -}}{{- end -}}{{- end -}}
{{- range $name := list "prefill" "decode" -}}{{- if get (get $config $name | default dict) "autoscaling" -}}{{- $_ := set $set (printf "%s.autoscaling" $name) true -}}{{- end -}}{{- end -}}
{{- if and $set.slo (eq $mode "disaggregated") (get $set "prefill.autoscaling") (get $set "decode.autoscaling") -}}
{{- if $set.pool_ratio -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" "" "message" "with slo and both pools autoscaling, one policy sizes the two pools together against the latency target: drop pool_ratio" "hint" "")) -}}
{{- end -}}
{{- $floor := 0 -}}
{{- range $name := list "prefill" "decode" -}}
{{- $autoscaling := get (get $config $name) "autoscaling" -}}
{{- $floor = add $floor (hasKey $autoscaling "min_replicas" | ternary (get $autoscaling "min_replicas") $defs.AutoscalingSpec.properties.min_replicas.default | int) -}}
{{- end -}}
{{- if and $set.max_total_replicas (lt (get $config "max_total_replicas" | int) $floor) -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" "" "message" (printf "max_total_replicas %d is below the pools' min_replicas together (%d)" (get $config "max_total_replicas" | int) $floor) "hint" "")) -}}
{{- end -}}
{{- else if $set.max_total_replicas -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" "" "message" "max_total_replicas is the budget of the joint autoscaling policy: it needs slo, mode disaggregated and autoscaling on both the prefill and the decode pool" "hint" "")) -}}
{{- end -}}
{{- if and $set.pool_ratio (or (ne $mode "disaggregated") (not (get $set "prefill.autoscaling")) (not (get $set "decode.autoscaling"))) -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" "" "message" "pool_ratio needs mode disaggregated and autoscaling on both the prefill and the decode pool" "hint" "")) -}}
{{- end -}}
{{- end -}}
{{- with get (get $config "gateway" | default dict) "api_keys" -}}
{{- $out = print $out (include "pdserve.check.problem" (dict "path" "gateway.api_keys" "message" "API keys given in the config would be rendered into the RayService's serveConfigV2 and shown on the Ray dashboard" "hint" "put them in apiKeys.keys (the chart keeps them in a Secret) or apiKeys.existingSecret")) -}}
{{- end -}}
{{- $out -}}
{{- end -}}

{{/* Marks path and every path above it (and the whole config) as holding a problem. Input: dict "broken" "path". */}}
{{- define "pdserve.check.mark" -}}
{{- $parts := splitList "." .path -}}
{{- $_ := set .broken "" true -}}
{{- range $i, $part := $parts -}}{{- $_ := set $.broken (slice $parts 0 (add1 $i) | join ".") true -}}{{- end -}}
{{- end -}}

{{/* "true" when a value reads as true the way pydantic reads a bool, else "". */}}
{{- define "pdserve.check.true" -}}
{{- if kindIs "string" . -}}{{- if has (lower .) (list "1" "on" "t" "true" "y" "yes") -}}true{{- end -}}
{{- else if kindIs "bool" . -}}{{- if . -}}true{{- end -}}
{{- else if not (kindIs "invalid" .) -}}{{- if eq (float64 .) 1.0 -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* A float as Python prints it: 2.0, 0.25. */}}
{{- define "pdserve.check.float" -}}
{{- if eq (floor .) (float64 .) -}}{{- printf "%.1f" (float64 .) -}}{{- else -}}{{- toString . -}}{{- end -}}
{{- end -}}
