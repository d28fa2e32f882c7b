{{/* The labels every object carries; the DaemonSet selects on app.kubernetes.io/name only. */}}
{{- define "tessera.labels" -}}
app.kubernetes.io/name: tesserad
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tessera.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Whether the DRA driver runs (modes dra and both). */}}
{{- define "tessera.dra" -}}
{{- if ne .Values.mode "device-plugin" }}true{{ end -}}
{{- end -}}

{{/*
The daemon's configuration: the user's `config`, with the keys the chart mounts or derives set
over it (values.yaml lists them).
*/}}
{{- define "tessera.config" -}}
{{- $c := deepCopy .Values.config -}}
{{- $k := get $c "kubernetes" | default dict -}}
{{- $_ := set $k "mode" .Values.mode -}}
{{- $_ := set $k "plugins_dir" (printf "%s/plugins" .Values.kubeletRoot) -}}
{{- $_ := set $k "plugins_registry_dir" (printf "%s/plugins_registry" .Values.kubeletRoot) -}}
{{- $_ := set $c "kubernetes" $k -}}
{{- $i := get $c "injection" | default dict -}}
{{- $_ := set $i "driver_root" "/driver-root" -}}
{{- $_ := set $i "host_driver_root" .Values.hostDriverRoot -}}
{{- $_ := set $i "cdi_spec_dir" "/var/run/cdi" -}}
{{- $_ := set $c "injection" $i -}}
{{- $t := get $c "telemetry" | default dict -}}
{{- if .Values.metrics.port }}
{{- $_ := set $t "metrics_listen" (printf "0.0.0.0:%d" (int .Values.metrics.port)) -}}
{{- else }}
{{- $_ := unset $t "metrics_listen" -}}
{{- end }}
{{- $_ := set $c "telemetry" $t -}}
{{- $_ := set $c "device_plugin_dir" (printf "%s/device-plugins/" .Values.kubeletRoot) -}}
{{- $_ := set $c "state_dir" "/var/lib/tessera" -}}
{{- $_ := set $c "runtime_dir" "/run/tessera" -}}
{{- $_ := set $c "pod_resources_socket" (printf "%s/pod-resources/kubelet.sock" .Values.kubeletRoot) -}}
# Rendered by the Helm chart from its values (deploy/helm/tessera/values.yaml); every option:
# docs/configuration.md. Paths are the host's, mounted at the same place, except the driver root
# (the host's {{ .Values.hostDriverRoot }} is mounted at /driver-root).
{{ include "tessera.toml" (dict "prefix" "" "table" $c) | trim }}
{{- end -}}

{{/*
A TOML table from a map: its plain keys first, then its sub-tables as [a."b"] sections. Keys are
always quoted (MIG profiles such as "1g.10gb" hold dots). Helm reads YAML numbers as floats: a
whole number is written as an integer, which is what every numeric key of the daemon takes.
*/}}
{{- define "tessera.toml" -}}
{{- $prefix := .prefix -}}
{{- range $k, $v := .table }}
{{- if not (kindIs "map" $v) }}
{{ toJson $k }} = {{ include "tessera.tomlValue" $v }}
{{- end }}
{{- end }}
{{- range $k, $v := .table }}
{{- if kindIs "map" $v }}
{{- $name := ternary (toJson $k) (printf "%s.%s" $prefix (toJson $k)) (eq $prefix "") }}
{{- $plain := false }}
{{- range $v }}{{ if not (kindIs "map" .) }}{{ $plain = true }}{{ end }}{{ end }}
{{- if or $plain (not $v) }}

[{{ $name }}]
{{- end }}
{{- include "tessera.toml" (dict "prefix" $name "table" $v) }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "tessera.tomlValue" -}}
{{- if kindIs "string" . -}}
{{ toJson . }}
{{- else if kindIs "bool" . -}}
{{ . }}
{{- else if or (kindIs "float64" .) (kindIs "float32" .) -}}
{{- if eq (float64 .) (floor .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else if or (kindIs "int" .) (kindIs "int64" .) (kindIs "int32" .) (kindIs "uint64" .) -}}
{{ . }}
{{- else if kindIs "slice" . -}}
[{{ range $i, $e := . }}{{ if $i }}, {{ end }}{{ include "tessera.tomlValue" $e }}{{ end }}]
{{- else if kindIs "map" . -}}
{ {{- range $i, $k := keys . | sortAlpha }}{{ if $i }},{{ end }} {{ toJson $k }} = {{ include "tessera.tomlValue" (get $ $k) }}{{ end }} }
{{- else -}}
{{ fail (printf "config: a value of kind %s cannot be written to TOML" (kindOf .)) }}
{{- end -}}
{{- end -}}
