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
The pipelines' workload kind: a Deployment with `layout: podPerPipeline`; otherwise
LeaderWorkerSet or StatefulSet: pipelines.kind, or for `auto` the kind this release's pipelines
already have in the cluster (sticky across upgrades: installing LWS later must not flip a
running release), else what the cluster serves. `lookup` finds nothing under `helm template`.
*/}}
{{- define "wavepp.pipelineKind" -}}
{{- if eq .Values.pipelines.layout "podPerPipeline" }}
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

{{/*
The pod template of one role: (dict "root" $ "role" "router|gateway|leader|stage"), plus
"index" i for the stages of StatefulSet pipeline i.
One helper for all four, so volumes, security, the model and the cache are set up the same
way everywhere; what differs is the command (_container.tpl), ports, probes and rendezvous.
The router and the leaders serve gRPC; the gateway serves HTTP (its /metrics on the same port).
*/}}
{{- define "wavepp.pod" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $router := eq .role "router" }}
{{- $gateway := eq .role "gateway" }}
{{- $pipeline := has .role (list "leader" "stage") }}
{{- $podPerPipeline := and $pipeline (eq $v.pipelines.layout "podPerPipeline") }}
{{- $gpus := 0 }}
{{- if and $pipeline $v.pipelines.gpus.enabled }}
{{- $gpus = ternary (int $v.pipelines.stages) 1 $podPerPipeline }}
{{- end }}
{{- $serves := has .role (list "leader" "router") }}
{{- $cfg := get (dict "router" $v.router "gateway" $v.gateway "leader" $v.pipelines "stage" $v.pipelines) .role }}
{{- $rdma := and $pipeline $v.pipelines.rdma.enabled }}
{{- $podSecurity := $cfg.podSecurityContext | default $v.podSecurityContext }}
{{- $initSecurity := $cfg.securityContext | default $v.securityContext }}
{{- $security := deepCopy $initSecurity }}
{{- if and $rdma $v.pipelines.rdma.ipcLock }}
{{- $caps := deepCopy (get $security "capabilities" | default dict) }}
{{- $_ := set $caps "add" (append (get $caps "add" | default list) "IPC_LOCK" | uniq) }}
{{- $_ := set $security "capabilities" $caps }}
{{- end }}
{{- $port := ternary $v.router.port $v.pipelines.port $router }}
{{- $metricsPort := ternary $v.gateway.port (ternary $v.router.metricsPort $v.pipelines.metricsPort $router) $gateway }}
{{- $tls := list }}
{{- if and (or $router $gateway) $v.tls.router.secretName }}{{ $tls = append $tls (dict "name" "router" "secret" $v.tls.router.secretName) }}{{ end }}
{{- if and $serves $v.tls.pipelines.secretName }}{{ $tls = append $tls (dict "name" "pipelines" "secret" $v.tls.pipelines.secretName) }}{{ end }}
{{- $serverTls := ternary $v.tls.router.secretName $v.tls.pipelines.secretName $router -}}
metadata:
  labels:
    {{- include "wavepp.componentSelector" (dict "root" $root "component" .role) | nindent 4 }}
    {{- if hasKey . "index" }}
    wavepp.io/pipeline: {{ .index | quote }}
    {{- end }}
    {{- with $cfg.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or $cfg.podAnnotations (and (or $serves $gateway) $v.metrics.podAnnotations) }}
  annotations:
    {{- if and (or $serves $gateway) $v.metrics.podAnnotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ $metricsPort | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with $cfg.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  {{- if $router }}
  serviceAccountName: {{ include "wavepp.routerServiceAccountName" $root }}
  {{- else if and $gateway (include "wavepp.gatewayDiscovers" $root) }}
  serviceAccountName: {{ include "wavepp.gatewayName" $root }}
  {{- else }}
  automountServiceAccountToken: false
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $podSecurity | nindent 4 }}
  {{- if and $rdma $v.pipelines.rdma.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  terminationGracePeriodSeconds: {{ $cfg.terminationGracePeriodSeconds }}
  {{- with $cfg.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $cfg.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- if or (has $v.model.source (list "bundled" "huggingface")) $cfg.extraInitContainers }}
  initContainers:
    {{- if eq $v.model.source "huggingface" }}
    {{- include "wavepp.downloadModel" (dict "root" $root "filesOnly" (not $pipeline) "securityContext" $initSecurity) | nindent 4 }}
    {{- end }}
    {{- if eq $v.model.source "bundled" }}
    - name: prepare-model
      image: {{ include "wavepp.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: [python, -c]
      args:
        - from prefill_node.model.default_model import ensure_default_model; print(ensure_default_model())
      env:
        {{- include "wavepp.commonEnv" $root | nindent 8 }}
      securityContext:
        {{- toYaml $initSecurity | nindent 8 }}
      volumeMounts:
        {{- include "wavepp.commonMounts" $root | nindent 8 }}
    {{- end }}
    {{- with $cfg.extraInitContainers }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  containers:
    - name: {{ .role }}
      image: {{ include "wavepp.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- include (printf "wavepp.command.%s" .role) . | trim | nindent 6 }}
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- include "wavepp.commonEnv" $root | nindent 8 }}
        {{- if and $pipeline (not $podPerPipeline) }}
        {{- include "wavepp.rendezvousEnv" . | trim | nindent 8 }}
        {{- end }}
        {{- if $pipeline }}
        {{- with include "wavepp.ucxEnv" $v.pipelines.ucx }}
        {{- . | trim | nindent 8 }}
        {{- end }}
        {{- if $rdma }}
        {{- include "wavepp.ncclEnv" $v.pipelines.rdma.nccl | trim | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- with $cfg.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $cfg.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $serves }}
      ports:
        - name: grpc
          containerPort: {{ $port }}
        - name: metrics
          containerPort: {{ $metricsPort }}
        {{- if not (or $router $podPerPipeline) }}
        - name: rendezvous
          containerPort: {{ $v.pipelines.rendezvousPort }}
        {{- end }}
      {{- $probes := include "wavepp.probeValues" (dict "cfg" $cfg "role" .role) | fromJson }}
      {{- include "wavepp.probes" (dict "port" $port "tls" (ne $serverTls "") "probes" $probes) | trim | nindent 6 }}
      {{- else if $gateway }}
      ports:
        - name: http
          containerPort: {{ $v.gateway.port }}
      {{- include "wavepp.httpProbes" $cfg | trim | nindent 6 }}
      {{- end }}
      {{- with include "wavepp.resources" (dict "resources" $cfg.resources "gpus" $gpus "gpu" $v.pipelines.gpus.resourceName "extra" (ternary $v.pipelines.rdma.resources dict $rdma)) }}
      resources:
        {{- . | trim | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $security | nindent 8 }}
      volumeMounts:
        {{- include "wavepp.commonMounts" $root | nindent 8 }}
        {{- if $pipeline }}
        - name: shm
          mountPath: /dev/shm
        {{- end }}
        {{- range $tls }}
        - name: tls-{{ .name }}
          mountPath: /etc/wavepp/tls/{{ .name }}
          readOnly: true
        {{- end }}
        {{- if $rdma }}
        {{- range $i, $path := $v.pipelines.rdma.devicePaths }}
        - name: rdma-device-{{ $i }}
          mountPath: {{ $path }}
        {{- end }}
        {{- end }}
        {{- with $cfg.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- with $cfg.sidecars }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  volumes:
    - name: cache
      emptyDir:
        sizeLimit: {{ $v.cache.sizeLimit }}
    - name: tmp
      emptyDir: {}
    {{- if $pipeline }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.pipelines.shmSizeLimit }}
    {{- end }}
    {{- if eq $v.model.source "pvc" }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ required "model.claimName is required with model.source=pvc" $v.model.claimName }}
        readOnly: true
    {{- else if eq $v.model.source "huggingface" }}
    - name: model
      emptyDir:
        sizeLimit: {{ ternary $v.model.huggingface.sizeLimit "64Mi" $pipeline }}
    {{- else if eq $v.model.source "hostPath" }}
    - name: model
      hostPath:
        path: {{ required "model.hostPath is required with model.source=hostPath" $v.model.hostPath }}
        type: Directory
    {{- end }}
    {{- range $tls }}
    - name: tls-{{ .name }}
      secret:
        secretName: {{ .secret }}
    {{- end }}
    {{- if $rdma }}
    {{- range $i, $path := $v.pipelines.rdma.devicePaths }}
    - name: rdma-device-{{ $i }}
      hostPath:
        path: {{ $path }}
    {{- end }}
    {{- end }}
    {{- with $cfg.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $cfg.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $affinity := $cfg.affinity }}
  {{- if and (not $affinity) $rdma $v.pipelines.rdma.hostNetwork (eq .role "leader") }}
  {{- $leaders := include "wavepp.componentSelector" (dict "root" $root "component" "leader") | fromYaml }}
  {{- $term := dict "labelSelector" (dict "matchLabels" $leaders) "topologyKey" "kubernetes.io/hostname" }}
  {{- $affinity = dict "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
  {{- end }}
  {{- with $affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
A container's resources: (dict "resources" {...} "gpus" N "gpu" "nvidia.com/gpu" ["extra"
{resource: count}]). With N > 0, N GPUs in the limits, and every `extra` resource (RDMA
devices); the request follows the limit for an extended resource; a limit the values set for
that resource explicitly wins.
*/}}
{{- define "wavepp.resources" -}}
{{- $resources := deepCopy (.resources | default dict) }}
{{- $add := deepCopy (.extra | default dict) }}
{{- if gt .gpus 0 }}
{{- $_ := set $add .gpu .gpus }}
{{- end }}
{{- if $add }}
{{- $limits := deepCopy (get $resources "limits" | default dict) }}
{{- range $name, $count := $add }}
{{- if not (hasKey $limits $name) }}
{{- $_ := set $limits $name $count }}
{{- end }}
{{- end }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- with $resources }}
{{- toYaml . }}
{{- end }}
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

{{/* Kueue admission of the pipelines (LWS or the podPerPipeline Deployment): its queue label. */}}
{{- define "wavepp.kueueLabels" -}}
{{- with .Values.pipelines.kueueQueueName }}
kueue.x-k8s.io/queue-name: {{ . }}
{{- end }}
{{- end }}
