{{/*
Names. The prefix is cut at 32 characters so that the longest derived name, a stage
StatefulSet `<prefix>-pipeline-<i>-stages`, stays within the 52 characters a StatefulSet name
may have (its pods' controller-revision-hash label appends 11).
*/}}
{{- define "wavepp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 32 | trimSuffix "-" }}
{{- end }}

{{- define "wavepp.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 32 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 32 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 32 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The router's Deployment, Service and Role. */}}
{{- define "wavepp.routerName" -}}
{{ include "wavepp.fullname" . }}-router
{{- end }}

{{/* The gateway's Deployment, Service, ServiceAccount and Role. */}}
{{- define "wavepp.gatewayName" -}}
{{ include "wavepp.fullname" . }}-gateway
{{- end }}

{{/* The gateway discovers its decode fleet from a Service's EndpointSlices (else static URLs). */}}
{{- define "wavepp.gatewayDiscovers" -}}
{{- if .Values.gateway.decode.serviceName }}true{{ end }}
{{- end }}

{{/* The LeaderWorkerSet, or the leaders' StatefulSet, and its headless Service: leader i is
pod `<pipelineName>-<i>`, reachable as `<pipelineName>-<i>.<pipelineName>.<namespace>.svc`. */}}
{{- define "wavepp.pipelineName" -}}
{{ include "wavepp.fullname" . }}-pipeline
{{- end }}

{{/* The headless Service of READY leaders whose EndpointSlices the router watches. */}}
{{- define "wavepp.pipelinesServiceName" -}}
{{ include "wavepp.fullname" . }}-pipelines
{{- end }}

{{- define "wavepp.routerServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "wavepp.routerName" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The pipelines' layout, `podPerPipeline` or `podPerStage`: pipelines.layout, or for `auto`
podPerPipeline where a pipeline fits one pod, i.e. its GPUs (`stages`, one per stage; none
without gpus.enabled) are at most pipelines.maxAcceleratorsPerPod, unless pipelines.kind names
a pod-per-stage kind or this release's pipelines already run pod per stage in the cluster
(sticky across upgrades, as the kind is: changing layout replaces every pipeline at once).
*/}}
{{- define "wavepp.layout" -}}
{{- $p := .Values.pipelines }}
{{- if ne $p.layout "auto" }}
{{- $p.layout }}
{{- else if ne $p.kind "auto" }}
{{- "podPerStage" }}
{{- else if include "wavepp.installedPipelineKind" . }}
{{- "podPerStage" }}
{{- else if and $p.gpus.enabled (gt (int $p.stages) (int $p.maxAcceleratorsPerPod)) }}
{{- "podPerStage" }}
{{- else }}
{{- "podPerPipeline" }}
{{- end }}
{{- end }}

{{/*
Port slots of host-network pipelines (pipelines.rdma.portSlots): 1 unless RDMA's hostNetwork
is on. More than one needs the podPerPipeline layout and fixed replicas: each slot is its own
Deployment.
*/}}
{{- define "wavepp.portSlots" -}}
{{- $r := .Values.pipelines.rdma }}
{{- if and $r.enabled $r.hostNetwork (gt (int $r.portSlots) 1) }}
{{- if ne (include "wavepp.layout" .) "podPerPipeline" }}
{{- fail "pipelines.rdma.portSlots > 1 needs the podPerPipeline layout (pod-per-stage leaders keep one per node: their stages find them by name, on one port)" }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- fail "pipelines.rdma.portSlots > 1 splits the pipelines over several Deployments, which one autoscaler cannot scale: disable autoscaling or use one slot" }}
{{- end }}
{{- int $r.portSlots }}
{{- else }}
{{- 1 }}
{{- end }}
{{- end }}

{{/* Why `layout: auto` chose what it chose, for NOTES. */}}
{{- define "wavepp.layoutReason" -}}
{{- $p := .Values.pipelines }}
{{- $gpus := ternary (int $p.stages) 0 $p.gpus.enabled }}
{{- if ne $p.kind "auto" }}
{{- printf "pipelines.kind=%s is a pod-per-stage kind" $p.kind }}
{{- else if include "wavepp.installedPipelineKind" . }}
{{- "the release's pipelines already run pod per stage; an upgrade keeps their layout" }}
{{- else if not $p.gpus.enabled }}
{{- "a CPU pipeline (gpus.enabled=false) fits one pod" }}
{{- else if gt $gpus (int $p.maxAcceleratorsPerPod) }}
{{- printf "%d GPUs per pipeline exceed pipelines.maxAcceleratorsPerPod=%d" $gpus (int $p.maxAcceleratorsPerPod) }}
{{- else }}
{{- printf "%d GPUs per pipeline fit pipelines.maxAcceleratorsPerPod=%d" $gpus (int $p.maxAcceleratorsPerPod) }}
{{- end }}
{{- end }}

{{/*
The pipelines' workload kind: a Deployment with the podPerPipeline layout; otherwise
LeaderWorkerSet or StatefulSet: pipelines.kind, or for `auto` the kind this release's pipelines
already have in the cluster (sticky across upgrades: installing LWS later must not flip a
running release), else what the cluster serves. `lookup` finds nothing under `helm template`.
*/}}
{{- define "wavepp.pipelineKind" -}}
{{- if eq (include "wavepp.layout" .) "podPerPipeline" }}
{{- "Deployment" }}
{{- else if ne .Values.pipelines.kind "auto" }}
{{- .Values.pipelines.kind }}
{{- else }}
{{- $installed := include "wavepp.installedPipelineKind" . }}
{{- if $installed }}
{{- $installed }}
{{- else if .Capabilities.APIVersions.Has "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet" }}
{{- "LeaderWorkerSet" }}
{{- else }}
{{- "StatefulSet" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The kind of this release's pipeline object in the cluster, empty if none (or no cluster). */}}
{{- define "wavepp.installedPipelineKind" -}}
{{- $name := include "wavepp.pipelineName" . }}
{{- $ns := .Release.Namespace }}
{{- if and (.Capabilities.APIVersions.Has "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet") (lookup "leaderworkerset.x-k8s.io/v1" "LeaderWorkerSet" $ns $name) }}
{{- "LeaderWorkerSet" }}
{{- else if lookup "apps/v1" "StatefulSet" $ns $name }}
{{- "StatefulSet" }}
{{- end }}
{{- end }}

{{/*
The pipelines' revision: a hash of every value that shapes a pipeline pod (not the replica
count), in every pipeline container as WAVEPP_PIPELINE_REVISION. A stage joins only a leader
of its own revision, so a roll never runs a pipeline of mixed versions.
*/}}
{{- define "wavepp.pipelineRevision" -}}
{{- $v := .Values }}
{{- $pipelines := omit $v.pipelines "replicas" "kind" }}
{{- $shape := dict "chart" .Chart.Version "image" $v.image "pipelines" $pipelines "model" $v.model "cache" $v.cache "grpc" $v.grpc "tls" $v.tls.pipelines "pod" $v.podSecurityContext "container" $v.securityContext }}
{{- /* Helm 4 drops null values from .Values, Helm 3 keeps them: hash without them */}}
{{- $json := regexReplaceAll `"[^"]*":null,` (toJson $shape) "" }}
{{- $json = regexReplaceAll `,?"[^"]*":null` $json "" }}
{{- $json | sha256sum | trunc 12 }}
{{- end }}

{{- define "wavepp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "wavepp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "wavepp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 }}
{{ include "wavepp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Metadata of a workload object (Deployment, StatefulSet, LeaderWorkerSet): (dict "root" $
"component" "router|gateway|leader|stage" "cfg" <its values> ["labels" {...}] ["annotations"
{...}]): the component's labels plus `cfg.labels`, and `cfg.annotations` plus the chart's own.
*/}}
{{- define "wavepp.workloadMetadata" -}}
labels:
  {{- include "wavepp.componentLabels" (dict "root" .root "component" .component) | nindent 2 }}
  {{- with merge (dict) (.labels | default dict) (.cfg.labels | default dict) }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with merge (dict) (.annotations | default dict) (.root.Values.commonAnnotations | default dict) (.cfg.annotations | default dict) }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Selector of one component's pods: (dict "root" $ "component" "router|leader|stage"). */}}
{{- define "wavepp.componentSelector" -}}
{{ include "wavepp.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of one component's objects: (dict "root" $ "component" ...). */}}
{{- define "wavepp.componentLabels" -}}
{{ include "wavepp.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "wavepp.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* A label selector of every pipeline pod of the release: leaders and stages. */}}
{{- define "wavepp.pipelinePodSelector" -}}
matchLabels:
  {{- include "wavepp.selectorLabels" . | nindent 2 }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [leader, stage]
{{- end }}

{{/* Kueue admission of the pipelines: the queue label of every pipeline workload object (the
LeaderWorkerSet, the podPerPipeline Deployment, or each StatefulSet). */}}
{{- define "wavepp.kueueLabels" -}}
{{- with .Values.pipelines.kueueQueueName }}
kueue.x-k8s.io/queue-name: {{ . }}
{{- end }}
{{- end }}
