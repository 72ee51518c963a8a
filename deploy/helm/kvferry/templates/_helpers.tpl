{{- define "kvferry.name" -}}kvferry{{- end -}}

{{- define "kvferry.fullname" -}}
{{- if contains "kvferry" .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-kvferry" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "kvferry.labels" -}}
app.kubernetes.io/name: {{ include "kvferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
Labels of every pod that carries the sidecar: the headless Service, the PodMonitor and the
NetworkPolicy select these, so your own worker pod carries them too (injection path):
  metadata:
    labels:
      app: my-engine
      {{- include "kvferry.sidecarLabels" .Subcharts.kvferry | nindent 6 }}
They name no app.kubernetes.io/* key, so they never clash with your pod's own labels.
*/}}
{{- define "kvferry.sidecarLabels" -}}
kvferry.io/sidecar: "true"
kvferry.io/release: {{ .Release.Name | quote }}
{{- end -}}

{{/* A component of this chart: its Deployment's selector (and the labels of its pods). */}}
{{- define "kvferry.componentLabels" -}}
{{ include "kvferry.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvferry.componentName" -}}
{{ printf "%s-%s" (include "kvferry.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "kvferry.tokenSecret" -}}
{{- if .Values.token.existingSecret -}}{{ .Values.token.existingSecret }}{{- else -}}{{ include "kvferry.fullname" . }}-token{{- end -}}
{{- end -}}

{{- define "kvferry.peerSecret" -}}
{{- if .Values.peerSecret.existingSecret -}}{{ .Values.peerSecret.existingSecret }}{{- else -}}{{ include "kvferry.fullname" . }}-peer{{- end -}}
{{- end -}}

{{/*
The sidecar container. Include it in your worker pod's containers (from a chart that depends on
this one; within this chart the context is `.`), with the pod's labels from
"kvferry.sidecarLabels", its volumes from "kvferry.volumes" and shareProcessNamespace: true:
  containers:
    - name: worker
      ...
    {{- include "kvferry.sidecar" .Subcharts.kvferry | nindent 4 }}
*/}}
{{- define "kvferry.sidecar" -}}
- name: kvferry
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["--host", "0.0.0.0", "--port", "{{ .Values.ports.control }}",
         "--data-host", "0.0.0.0", "--data-port", "{{ .Values.ports.data }}"
         {{- with .Values.ports.grpc }}, "--grpc-port", "{{ . }}"{{ end }}]
  ports:
    - {name: control, containerPort: {{ .Values.ports.control }}, protocol: TCP}
    - {name: data, containerPort: {{ .Values.ports.data }}, protocol: TCP}
    {{- with .Values.ports.grpc }}
    - {name: grpc, containerPort: {{ . }}, protocol: TCP}
    {{- end }}
  env:
    - name: KVFERRY_ADVERTISE_HOST
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    {{- range $key, $value := .Values.config }}
    {{- if not (has $key (list "token" "peer_secret")) }}{{/* secrets only ever come from a Secret */}}
    - name: {{ printf "KVFERRY_%s" (upper $key) }}
      {{- /* YAML integers arrive as floats: print whole numbers without an exponent */}}
      value: {{ if and (kindIs "float64" $value) (eq (floor $value) $value) }}{{ int64 $value | quote }}{{ else }}{{ $value | quote }}{{ end }}
    {{- end }}
    {{- end }}
    - {name: HOME, value: /tmp}  # the root filesystem is read-only; caches (CuPy kernels) go to /tmp
    - {name: CUPY_CACHE_DIR, value: /tmp/cupy}
    {{- if not (or .Values.token.existingSecret .Values.token.create) }}
    {{- fail "the control API listens on the pod's address: set token.existingSecret or token.create" }}
    {{- end }}
    - name: KVFERRY_TOKEN
      valueFrom: {secretKeyRef: {name: {{ include "kvferry.tokenSecret" . }}, key: token}}
    {{- if not (or .Values.peerSecret.existingSecret .Values.peerSecret.create) }}
    {{- fail "the data port listens on the pod's address: set peerSecret.existingSecret or peerSecret.create" }}
    {{- end }}
    - name: KVFERRY_PEER_SECRET
      valueFrom: {secretKeyRef: {name: {{ include "kvferry.peerSecret" . }}, key: peer-secret}}
    - name: NVIDIA_VISIBLE_DEVICES
      value: {{ .Values.gpuVisibility | quote }}
    {{- include "kvferry.mpsEnv" . | nindent 4 }}
    {{- with .Values.ucx.tls }}
    - {name: UCX_TLS, value: {{ . | quote }}}
    {{- end }}
    {{- with .Values.ucx.netDevices }}
    - {name: UCX_NET_DEVICES, value: {{ . | quote }}}
    {{- end }}
    - {name: UCX_TCP_TX_SEG_SIZE, value: {{ .Values.ucx.tcpSegSize | quote }}}
    - {name: UCX_TCP_RX_SEG_SIZE, value: {{ .Values.ucx.tcpSegSize | quote }}}
    {{- range $key, $value := .Values.ucx.extraEnv }}
    - {name: {{ $key }}, value: {{ $value | quote }}}
    {{- end }}
  readinessProbe:
    httpGet: {path: /readyz, port: control}
    {{- toYaml .Values.probes.readiness | nindent 4 }}
  livenessProbe:
    httpGet: {path: /healthz, port: control}
    {{- toYaml .Values.probes.liveness | nindent 4 }}
  resources:
    {{- $resources := deepCopy .Values.resources }}
    {{- if and .Values.rdma.enabled .Values.rdma.resources }}
    {{- $_ := set $resources "limits" (merge (default dict $resources.limits) .Values.rdma.resources) }}
    {{- $_ := set $resources "requests" (merge (default dict $resources.requests) .Values.rdma.resources) }}
    {{- end }}
    {{- toYaml $resources | nindent 4 }}
  securityContext:
    {{- $security := deepCopy .Values.securityContext }}
    {{- if .Values.rdma.enabled }}
    {{- $_ := set $security "capabilities" (dict "add" (list "IPC_LOCK")) }}
    {{- end }}
    {{- toYaml $security | nindent 4 }}
  volumeMounts:
    - {name: {{ .Values.shm.volume }}, mountPath: /dev/shm}  # the worker mounts it too: CPU KV regions are shm segments
    - {name: kvferry-tmp, mountPath: /tmp}
    {{- include "kvferry.mpsMount" . | nindent 4 }}
{{- end -}}

{{/* CUDA MPS's pipe directory (mps.pipeDirectory), for every container that uses the GPU: its
variable and its mount; nothing when it is not set. */}}
{{- define "kvferry.mpsEnv" -}}
{{- with .Values.mps.pipeDirectory }}
- {name: CUDA_MPS_PIPE_DIRECTORY, value: {{ . | quote }}}
{{- end }}
{{- end -}}

{{- define "kvferry.mpsMount" -}}
{{- with .Values.mps.pipeDirectory }}
- {name: kvferry-mps, mountPath: {{ . | quote }}}
{{- end }}
{{- end -}}

{{/*
The volumes the sidecar mounts, for the pod's volumes (the worker mounts the shm volume at
/dev/shm too):
  volumes:
    {{- include "kvferry.volumes" .Subcharts.kvferry | nindent 4 }}
With shm.defineVolume false it leaves out the shm volume (your pod already defines one named
shm.volume).
*/}}
{{- define "kvferry.volumes" -}}
{{- if .Values.shm.defineVolume -}}
{{ include "kvferry.shmVolume" . }}
{{ end -}}
- name: kvferry-tmp
  emptyDir: {}
{{- with .Values.mps.pipeDirectory }}
- name: kvferry-mps
  hostPath: {path: {{ . | quote }}, type: Directory}
{{- end }}
{{- end -}}

{{- define "kvferry.shmVolume" -}}
- name: {{ .Values.shm.volume }}
  emptyDir: {medium: Memory, sizeLimit: {{ .Values.shm.sizeLimit }}}
{{- end -}}

{{/* The volumes of this chart's own pods: the shm volume whatever shm.defineVolume says. */}}
{{- define "kvferry.podVolumes" -}}
{{ include "kvferry.volumes" . }}
{{- if not .Values.shm.defineVolume }}
{{ include "kvferry.shmVolume" . }}
{{- end }}
{{- end -}}
