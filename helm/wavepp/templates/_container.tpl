{{/*
What runs in each container: the command lines of the four roles (they drive the real CLI:
`wavepp serve` on the leader, stage 0; `wavepp stage` on stages 1..P-1; `wavepp router`;
`wavepp gateway`), the flags every gRPC server shares, the probes, the rendezvous
environment, and the environment and mounts every container has. tests/test_helm_chart.py parses the commands with wavepp's own
parsers. Each command helper takes (dict "root" $ ["index" i]).
*/}}

{{/* Integer flags go through `int`: Helm reads numbers from values files as float64, and
1048576 would print as 1.048576e+06. */}}
{{- define "wavepp.command.leader" -}}
{{- $v := .root.Values }}
{{- $p := $v.pipelines -}}
command: [wavepp]
args:
  - serve
  - --stages={{ int $p.stages }}
  - --policy={{ $p.policy }}
  - --num-blocks={{ $p.numBlocks }}
  - --block-size={{ int $p.blockSize }}
  - --max-chunk-tokens={{ int $p.maxChunkTokens }}
  {{- with $p.minWaveTokens }}
  - --min-wave-tokens={{ int . }}
  {{- end }}
  {{- with $p.waveOverheadTokens }}
  - --wave-overhead-tokens={{ int . }}
  {{- end }}
  {{- with $p.maxModelLen }}
  - --max-model-len={{ int . }}
  {{- end }}
  - --dtype={{ $p.dtype }}
  - --device={{ ternary "cuda" $p.device $p.gpus.enabled }}
  {{- with $p.threads }}
  - --threads={{ int . }}
  {{- end }}
  - --port={{ add $p.port (.slot | default 0) }}
  - --metrics-port={{ add $p.metricsPort (.slot | default 0) }}
  - --stage-wait={{ int $p.stageWaitSeconds }}
  {{- if $p.kvShipping.enabled }}
  {{- range $p.kvShipping.allow }}
  - --kv-allow={{ . }}
  {{- end }}
  - --kv-metadata-host={{ $p.kvShipping.metadataHost }}
  - --kv-progress={{ $p.kvShipping.progress }}
  - --kv-stream={{ ternary "on" "off" $p.kvShipping.stream }}
  - --kv-stream-layer-groups={{ $p.kvShipping.streamLayerGroups }}
  - --kv-transfer-timeout={{ $p.kvShipping.transferTimeoutSeconds }}
  - --kv-lease-ttl={{ $p.kvShipping.leaseTtlSeconds }}
  {{- else }}
  - --no-kv-shipping
  {{- end }}
  {{- include "wavepp.serverArgs" .root | nindent 2 }}
  {{- with include "wavepp.serverTlsArgs" (dict "tls" $v.tls.pipelines "name" "pipelines") }}
  {{- . | trim | nindent 2 }}
  {{- end }}
  {{- with $p.extraArgs }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* A LeaderWorkerSet stage gets RANK from LWS_WORKER_INDEX; a StatefulSet stage is pod
`<pipeline>-<i>-stages-<k>` and runs stage k+1 ($$ is kubelet's escape for a literal $). */}}
{{- define "wavepp.command.stage" -}}
{{- $connect := printf "--connect-timeout=%v" .root.Values.pipelines.connectTimeoutSeconds -}}
{{- if eq (include "wavepp.pipelineKind" .root) "LeaderWorkerSet" }}
command: [wavepp]
args: [stage, {{ $connect }}]
{{- else }}
command: [/bin/sh, -c]
args:
  - export RANK=$$((${HOSTNAME##*-} + 1)) && exec wavepp stage {{ $connect }}
{{- end }}
{{- end }}

{{- define "wavepp.command.router" -}}
{{- $v := .root.Values -}}
{{- if eq $v.router.policy "fetch" }}
{{- if not $v.pipelines.kvShipping.enabled }}
{{- fail "router.policy=fetch needs pipelines.kvShipping.enabled: a pipeline copies a prefix from another pipeline's stages over their NIXL agents" }}
{{- end }}
{{- if not $v.pipelines.kvShipping.allow }}
{{- fail "router.policy=fetch needs the pipelines' pod CIDR in pipelines.kvShipping.allow: the stages READ prefixes from other pipelines' pods, and the default allows loopback only" }}
{{- end }}
{{- end }}
command: [wavepp]
args:
  - router
  - --k8s-service={{ include "wavepp.pipelinesServiceName" .root }}
  - --namespace={{ .root.Release.Namespace }}
  - --k8s-port-name=grpc
  - --policy={{ $v.router.policy }}
  - --port={{ int $v.router.port }}
  - --metrics-port={{ int $v.router.metricsPort }}
  - --pending-ttl={{ $v.router.pendingTtlSeconds }}
  - --poll-interval={{ $v.router.pollIntervalSeconds }}
  - --max-inflight-per-pipeline={{ int $v.router.flowControl.maxInflightPerPipeline }}
  - --max-queue={{ int $v.router.flowControl.maxQueue }}
  - --max-wait={{ $v.router.flowControl.maxWaitSeconds }}
  {{- include "wavepp.serverArgs" .root | nindent 2 }}
  {{- with include "wavepp.serverTlsArgs" (dict "tls" $v.tls.router "name" "router") }}
  {{- . | trim | nindent 2 }}
  {{- end }}
  {{- if $v.tls.pipelines.secretName }}
  - --pipeline-ca=/etc/wavepp/tls/pipelines/ca.crt
  {{- if $v.tls.pipelines.clientAuth }}
  - --pipeline-cert=/etc/wavepp/tls/pipelines/tls.crt
  - --pipeline-key=/etc/wavepp/tls/pipelines/tls.key
  {{- end }}
  {{- end }}
  {{- with $v.router.extraArgs }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* `wavepp gateway`: the prefill tier is the release's router (unless `prefill` is `local`
or the router is off: then every prompt is computed on decode), the decode fleet is a list of
URLs or a Service's EndpointSlices. */}}
{{- define "wavepp.command.gateway" -}}
{{- $v := .root.Values -}}
{{- $g := $v.gateway -}}
command: [wavepp]
args:
  - gateway
  {{- if and $v.router.enabled (ne $g.prefill "local") }}
  - --router={{ include "wavepp.routerName" .root }}:{{ int $v.router.port }}
  {{- if $v.tls.router.secretName }}
  - --router-ca=/etc/wavepp/tls/router/ca.crt
  {{- if $v.tls.router.clientAuth }}
  - --router-cert=/etc/wavepp/tls/router/tls.crt
  - --router-key=/etc/wavepp/tls/router/tls.key
  {{- end }}
  {{- end }}
  {{- end }}
  - --prefill={{ $g.prefill }}
  - --local-max-tokens={{ int $g.localMaxTokens }}
  - --max-tier-queue={{ $g.maxTierQueueSeconds }}
  - --decode-prefill-rate={{ $g.decodePrefillRate }}
  - --prefill-timeout={{ $g.prefillTimeoutSeconds }}
  {{- if include "wavepp.gatewayDiscovers" .root }}
  - --k8s-service={{ $g.decode.serviceName }}
  - --namespace={{ $g.decode.namespace | default .root.Release.Namespace }}
  - --k8s-port-name={{ $g.decode.portName }}
  {{- else }}
  {{- if not $g.decode.urls }}
  {{- fail "gateway.enabled needs a decode fleet: gateway.decode.urls or gateway.decode.serviceName" }}
  {{- end }}
  {{- range $g.decode.urls }}
  - --decode={{ . }}
  {{- end }}
  {{- end }}
  {{- with $g.decode.kvEventsPort }}
  - --decode-kv-events-port={{ int . }}
  {{- end }}
  - --decode-poll-interval={{ $g.decode.pollIntervalSeconds }}
  {{- with $g.servedModelName }}
  - --served-model-name={{ . }}
  {{- end }}
  - --port={{ int $g.port }}
  - --log-level={{ $v.grpc.logLevel }}
  {{- if ne $v.model.source "bundled" }}
  - --model={{ $v.model.mountPath }}
  {{- end }}
  {{- with $g.extraArgs }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* Server TLS flags from a Secret mounted at /etc/wavepp/tls/<name>: (dict "tls" ... "name" ...). */}}
{{- define "wavepp.serverTlsArgs" -}}
{{- if .tls.secretName }}
- --tls-cert=/etc/wavepp/tls/{{ .name }}/tls.crt
- --tls-key=/etc/wavepp/tls/{{ .name }}/tls.key
{{- if .tls.clientAuth }}
- --tls-client-ca=/etc/wavepp/tls/{{ .name }}/ca.crt
{{- end }}
{{- end }}
{{- end }}

{{/* Flags every gRPC server (leader, router) shares. */}}
{{- define "wavepp.serverArgs" -}}
- --max-message-mb={{ int .Values.grpc.maxMessageMb }}
- --grace={{ .Values.grpc.graceSeconds }}
- --log-level={{ .Values.grpc.logLevel }}
{{- if ne .Values.model.source "bundled" }}
- --model={{ .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/*
Startup, liveness and readiness probes of a gRPC server: (dict "port" N "tls" bool "probes"
{startup, liveness, readiness: {periodSeconds, timeoutSeconds, failureThreshold}}). Native gRPC
probes (liveness: service "", readiness: the PrefillService); kubelet's gRPC probe speaks no
TLS, so a TLS server gets TCP probes (a leader whose pipeline died exits by itself, so TCP
probes lose nothing).
*/}}
{{- define "wavepp.probes" -}}
{{- $ctx := . -}}
{{- range $probe, $service := dict "startup" "" "liveness" "" "readiness" "wavepp.prefill.v1.PrefillService" }}
{{ $probe }}Probe:
  {{- if $ctx.tls }}
  tcpSocket:
    port: grpc
  {{- else }}
  grpc:
    port: {{ $ctx.port }}
    service: {{ $service | quote }}
  {{- end }}
  {{- include "wavepp.probeTiming" (get $ctx.probes $probe) | nindent 2 }}
{{- end }}
{{- end }}

{{/* periodSeconds, timeoutSeconds and failureThreshold of one probe (its values). */}}
{{- define "wavepp.probeTiming" -}}
periodSeconds: {{ int .periodSeconds }}
timeoutSeconds: {{ int .timeoutSeconds }}
failureThreshold: {{ int .failureThreshold }}
{{- end }}

{{/*
The probes of a role's values (router, gateway or pipelines): liveness and readiness as set;
a leader's startup allowance covers its own load (`startupProbe.loadSeconds`) plus the time it
waits for its stages (`stageWaitSeconds`, `wavepp serve --stage-wait`), so the leader gives up
on a missing stage by itself before kubelet would kill it.
*/}}
{{- define "wavepp.probeValues" -}}
{{- $startup := deepCopy .cfg.startupProbe }}
{{- if eq .role "leader" }}
{{- $allowance := add .cfg.stageWaitSeconds .cfg.startupProbe.loadSeconds }}
{{- $period := int .cfg.startupProbe.periodSeconds }}
{{- $_ := set $startup "failureThreshold" (div (add $allowance $period -1) $period) }}
{{- end }}
{{- toJson (dict "startup" $startup "liveness" .cfg.livenessProbe "readiness" .cfg.readinessProbe) }}
{{- end }}

{{/*
Probes of the gateway's HTTP server: (the gateway values). Startup and liveness ask
/v1/models (answered while the server runs), readiness /health (503 while no decode instance
is ready, so the Service sends no client to a gateway that cannot answer).
*/}}
{{- define "wavepp.httpProbes" -}}
{{- range $probe, $path := dict "startup" "/v1/models" "liveness" "/v1/models" "readiness" "/health" }}
{{ $probe }}Probe:
  httpGet:
    path: {{ $path }}
    port: http
  {{- include "wavepp.probeTiming" (get $ (printf "%sProbe" $probe)) | nindent 2 }}
{{- end }}
{{- end }}

{{/*
torchrun-style rendezvous of a pipeline pod: (dict "root" $ "role" "leader|stage" ["index" i]).
The leader is RANK 0 and hosts the store on its own IP; a stage finds it through the
LeaderWorkerSet's variables, or (StatefulSet) through the leaders' headless Service, which
publishes not-ready pods: a leader turns ready only after its stages joined. A StatefulSet
stage's RANK comes from its ordinal, in its command.
*/}}
{{- define "wavepp.rendezvousEnv" -}}
{{- $root := .root }}
{{- $lws := eq (include "wavepp.pipelineKind" $root) "LeaderWorkerSet" -}}
{{- if eq .role "leader" }}
- name: RANK
  value: "0"
{{- else if $lws }}
- name: RANK
  value: $(LWS_WORKER_INDEX)
{{- end }}
- name: WORLD_SIZE
  value: {{ $root.Values.pipelines.stages | quote }}
- name: MASTER_ADDR
{{- if eq .role "leader" }}
  value: $(POD_IP)
{{- else if $lws }}
  value: $(LWS_LEADER_ADDRESS)
{{- else }}
  {{- $leaders := include "wavepp.pipelineName" $root }}
  value: {{ printf "%s-%d.%s.%s.svc" $leaders (int .index) $leaders $root.Release.Namespace }}
{{- end }}
- name: MASTER_PORT
  value: {{ $root.Values.pipelines.rendezvousPort | quote }}
- name: WAVEPP_PIPELINE_REVISION
  value: {{ include "wavepp.pipelineRevision" $root | quote }}
{{- end }}

{{/* UCX / NIXL environment of every pipeline container, from pipelines.ucx: only what is set
(UCX_TLS, UCX_NET_DEVICES, then extraEnv in name order). */}}
{{- define "wavepp.ucxEnv" -}}
{{- with .transports }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with .devices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- range $name, $value := .extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}

{{/* Environment of every wavepp container (init containers included). */}}
{{- define "wavepp.commonEnv" -}}
- name: WAVEPP_CACHE_DIR
  value: {{ .Values.cache.path }}
- name: HOME
  value: /tmp
{{- end }}

{{/* Tracing of every wavepp process (docs/tracing.md): the standard OTLP variable, which
`wavepp serve / stage / router / gateway` read when no --otlp-endpoint is given. */}}
{{- define "wavepp.tracingEnv" -}}
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end }}


{{/* Mounts of every wavepp container: the cache, a writable /tmp, the model: (dict "root" $
"filesOnly" bool); filesOnly: the model volume is the pod's copy of the config and tokenizer
files (wavepp.copyModelFiles), not the claim (so no subPath). */}}
{{- define "wavepp.commonMounts" -}}
{{- $v := .root.Values -}}
- name: cache
  mountPath: {{ $v.cache.path }}
- name: tmp
  mountPath: /tmp
{{- if ne $v.model.source "bundled" }}
- name: model
  mountPath: {{ $v.model.mountPath }}
  readOnly: true
  {{- with (and (eq $v.model.source "pvc") (not .filesOnly) $v.model.subPath) }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/* What a router or gateway reads of a checkpoint (prefill_node/cli/router.py, gateway.py:
load_hf_config and Tokenizer.from_dir read config.json, tokenizer.json and
tokenizer_config.json, which holds the chat template), plus the files a checkpoint may keep
its generation settings and chat template in: glob patterns, comma-separated. */}}
{{- define "wavepp.modelFilePatterns" -}}
config.json,generation_config.json,tokenizer.json,tokenizer_config.json,special_tokens_map.json,chat_template.json,*.jinja
{{- end }}

{{/*
`model.source: pvc | hostPath` in a router or gateway pod: an init container copies the
config and tokenizer files (wavepp.modelFilePatterns) from the checkpoint, mounted read-only
at /wavepp/model-source in this container alone, into the pod's small model emptyDir at
`model.mountPath`: the main container never mounts the weights, and sees the same path (the
model's identity in block hashes may be the directory's name): (dict "root" $
"securityContext" {...}).
*/}}
{{- define "wavepp.copyModelFiles" -}}
{{- $v := .root.Values -}}
- name: copy-model-files
  image: {{ include "wavepp.image" .root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: [python, -c]
  args:
    - import glob, os, shutil, sys; source, target, patterns = sys.argv[1:4]; copied = [shutil.copy(f, target) for p in patterns.split(",") for f in sorted(glob.glob(os.path.join(source, p))) if os.path.isfile(f)]; print("\n".join(copied)); os.path.isfile(os.path.join(target, "config.json")) or sys.exit(f"no config.json in the checkpoint {source}")
    - /wavepp/model-source
    - {{ $v.model.mountPath }}
    - {{ include "wavepp.modelFilePatterns" .root | quote }}
  env:
    {{- include "wavepp.commonEnv" .root | nindent 4 }}
  securityContext:
    {{- toYaml .securityContext | nindent 4 }}
  volumeMounts:
    - name: model-source
      mountPath: /wavepp/model-source
      readOnly: true
      {{- with (and (eq $v.model.source "pvc") $v.model.subPath) }}
      subPath: {{ . }}
      {{- end }}
    - name: model
      mountPath: {{ $v.model.mountPath }}
{{- end }}

{{/*
`model.source: huggingface`: an init container that downloads the checkpoint into the pod's
model emptyDir with huggingface_hub (a dependency of the image's tokenizers), the token from
`model.huggingface.tokenSecret`: (dict "root" $ "filesOnly" bool "securityContext" {...}). filesOnly (router, gateway):
only the config and tokenizer files, which is all they read.
*/}}
{{- define "wavepp.downloadModel" -}}
{{- $v := .root.Values }}
{{- $hf := $v.model.huggingface -}}
- name: download-model
  image: {{ include "wavepp.image" .root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: [python, -c]
  args:
    - import sys; from huggingface_hub import snapshot_download; repo, revision, path, files = sys.argv[1:5]; print(snapshot_download(repo_id=repo, revision=revision, local_dir=path, allow_patterns=files.split(",") if files else None))
    - {{ required "model.huggingface.id is required with model.source=huggingface" $hf.id }}
    - {{ $hf.revision }}
    - {{ $v.model.mountPath }}
    - {{ ternary (include "wavepp.modelFilePatterns" .root) "" .filesOnly | quote }}
  env:
    {{- include "wavepp.commonEnv" .root | nindent 4 }}
    - name: HF_HOME
      value: /tmp/huggingface
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- with $hf.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $hf.tokenSecret.key }}
    {{- end }}
  securityContext:
    {{- toYaml .securityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: model
      mountPath: {{ $v.model.mountPath }}
{{- end }}

{{/* NCCL over InfiniBand / RoCE for the stages' activations (pipelines.rdma.nccl): only what is
set, then extraEnv in name order. */}}
{{- define "wavepp.ncclEnv" -}}
- name: NCCL_IB_DISABLE
  value: "0"
{{- with .ibHca }}
- name: NCCL_IB_HCA
  value: {{ . | quote }}
{{- end }}
{{- with .ibGidIndex }}
- name: NCCL_IB_GID_INDEX
  value: {{ . | quote }}
{{- end }}
{{- with .socketIfname }}
- name: NCCL_SOCKET_IFNAME
  value: {{ . | quote }}
{{- end }}
{{- range $name, $value := .extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
