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
{{- $podPerPipeline := and $pipeline (eq (include "wavepp.layout" $root) "podPerPipeline") }}
{{- $gpus := 0 }}
{{- if and $pipeline $v.pipelines.gpus.enabled }}
{{- $gpus = ternary (int $v.pipelines.stages) 1 $podPerPipeline }}
{{- end }}
{{- $serves := has .role (list "leader" "router") }}
{{- /* routers and gateways read only the model's config and tokenizer: a copy of those */}}
{{- $copiesModelFiles := and (not $pipeline) (has $v.model.source (list "pvc" "hostPath")) }}
{{- $cfg := get (dict "router" $v.router "gateway" $v.gateway "leader" $v.pipelines "stage" $v.pipelines) .role }}
{{- $rdma := and $pipeline $v.pipelines.rdma.enabled }}
{{- /* the node's IPC namespace and its /dev/shm instead of the pod's own */}}
{{- $hostIPC := and $pipeline $v.pipelines.hostIPC }}
{{- $podSecurity := $cfg.podSecurityContext | default $v.podSecurityContext }}
{{- $initSecurity := $cfg.securityContext | default $v.securityContext }}
{{- $security := deepCopy $initSecurity }}
{{- if and $rdma $v.pipelines.rdma.ipcLock }}
{{- $caps := deepCopy (get $security "capabilities" | default dict) }}
{{- $_ := set $caps "add" (append (get $caps "add" | default list) "IPC_LOCK" | uniq) }}
{{- $_ := set $security "capabilities" $caps }}
{{- end }}
{{- $slot := int (.slot | default 0) }}
{{- $port := ternary $v.router.port (add $v.pipelines.port $slot) $router }}
{{- $metricsPort := ternary $v.gateway.port (ternary $v.router.metricsPort (add $v.pipelines.metricsPort $slot) $router) $gateway }}
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
    {{- if hasKey . "slot" }}
    wavepp.io/port-slot: {{ .slot | quote }}
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
  {{- if $hostIPC }}
  hostIPC: true
  {{- end }}
  terminationGracePeriodSeconds: {{ $cfg.terminationGracePeriodSeconds }}
  {{- with $cfg.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $cfg.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- if or (has $v.model.source (list "bundled" "huggingface")) $copiesModelFiles $cfg.extraInitContainers }}
  initContainers:
    {{- if eq $v.model.source "huggingface" }}
    {{- include "wavepp.downloadModel" (dict "root" $root "filesOnly" (not $pipeline) "securityContext" $initSecurity) | nindent 4 }}
    {{- end }}
    {{- if $copiesModelFiles }}
    {{- include "wavepp.copyModelFiles" (dict "root" $root "securityContext" $initSecurity) | nindent 4 }}
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
        {{- include "wavepp.commonMounts" (dict "root" $root) | nindent 8 }}
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
        {{- include "wavepp.tracingEnv" $root | nindent 8 }}
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
        {{- include "wavepp.commonMounts" (dict "root" $root "filesOnly" $copiesModelFiles) | nindent 8 }}
        {{- if and $pipeline (not $hostIPC) }}
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
    {{- if and $pipeline (not $hostIPC) }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.pipelines.shmSizeLimit }}
    {{- end }}
    {{- if $copiesModelFiles }}
    - name: model
      emptyDir:
        sizeLimit: 64Mi
    {{- end }}
    {{- if eq $v.model.source "pvc" }}
    - name: {{ ternary "model-source" "model" $copiesModelFiles }}
      persistentVolumeClaim:
        claimName: {{ required "model.claimName is required with model.source=pvc" $v.model.claimName }}
        readOnly: true
    {{- else if eq $v.model.source "huggingface" }}
    - name: model
      emptyDir:
        sizeLimit: {{ ternary $v.model.huggingface.sizeLimit "64Mi" $pipeline }}
    {{- else if eq $v.model.source "hostPath" }}
    - name: {{ ternary "model-source" "model" $copiesModelFiles }}
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
  {{- if hasKey . "slot" }}
  {{- $_ := set $leaders "wavepp.io/port-slot" (toString .slot) }}
  {{- end }}
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
