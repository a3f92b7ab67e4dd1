{{/* The release's full name: fullnameOverride; else "<release>" when it already contains the chart name (or
nameOverride), else "<release>-<chart name or nameOverride>". */}}
{{- define "pdpool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdpool.labels" -}}
app.kubernetes.io/name: pdpool-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: pdpool
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The release's labels with the user's extra ones (a dict, "extra") merged in: an extra label replaces a
standard one of the same key (one key each: a mapping with a key twice is refused at install), except the selector
labels, which always stay what the Deployment selects. Called with (dict "ctx" $ "extra" <labels>). */}}
{{- define "pdpool.labelsWith" -}}
{{- $selector := include "pdpool.selectorLabels" .ctx | fromYaml -}}
{{- toYaml (merge $selector (deepCopy (.extra | default dict)) (include "pdpool.labels" .ctx | fromYaml)) -}}
{{- end -}}

{{- define "pdpool.selectorLabels" -}}
app.kubernetes.io/name: pdpool-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator's leader-election Lease: one per release, so that two releases in a namespace each elect their
own leader. "<full name>-operator" keeps "pdpool-operator" for the release named pdpool (an upgrade keeps its
Lease). */}}
{{- define "pdpool.leaseName" -}}
{{- default (printf "%s-operator" (include "pdpool.fullname" .)) .Values.operator.leaseName -}}
{{- end -}}

{{- define "pdpool.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{/*
The pool defaults the operator applies under every pool: .Values.poolDefaults, with the rdma values and the
scrapers' NetworkPolicy peers merged in (poolDefaults wins where both set a key).
*/}}
{{- define "pdpool.poolDefaults" -}}
{{- $d := deepCopy (.Values.poolDefaults | default dict) -}}
{{- $derived := dict -}}
{{- if .Values.rdma.enabled -}}
{{- $r := .Values.rdma -}}
{{- $kv := dict "rdma" (dict "ipcLock" $r.ipcLock) -}}
{{- if $r.shmSize }}{{ $_ := set $kv "shmSize" $r.shmSize }}{{ end -}}
{{- if $r.ucxTls }}{{ $_ := set $kv "ucxTls" $r.ucxTls }}{{ end -}}
{{- if $r.ucxNetDevices }}{{ $_ := set $kv "ucxNetDevices" $r.ucxNetDevices }}{{ end -}}
{{- $_ := set $derived "kvTransfer" $kv -}}
{{- if $r.resourceName -}}
{{- $res := dict "resources" (dict "limits" (dict $r.resourceName (int $r.resourceCount))) -}}
{{- $_ := set $derived "prefill" $res -}}
{{- $_ := set $derived "decode" (deepCopy $res) -}}
{{- end -}}
{{- if $r.topologyKey -}}
{{- $_ := set $derived "placement" (dict "topologyKey" $r.topologyKey "mode" $r.placement) -}}
{{- end -}}
{{- end -}}
{{- if .Values.monitoring.scrapeFrom -}}
{{- $_ := set $derived "networkPolicy" (dict "scrapeFrom" .Values.monitoring.scrapeFrom) -}}
{{- end -}}
{{- toYaml (mergeOverwrite $derived $d) -}}
{{- end -}}
