{{/* Where the nodes and the engines meet etcd (cluster membership). */}}
{{- define "kvpool.etcdUrl" -}}
{{ ternary "https" "http" .Values.tls.enabled }}://kvpool-etcd.{{ .Values.namespace }}.svc:2379
{{- end }}

{{/* An image of the chart: repository:tag, the tag the chart's appVersion by default. */}}
{{- define "kvpool.image" -}}
{{ .image.repository }}:{{ .image.tag | default .chart.AppVersion }}
{{- end }}

{{/* The Secrets every pod reads: the operator's, or the chart's own. */}}
{{- define "kvpool.accessSecret" -}}
{{ .Values.existingAccessSecret | default "kvpool-access" }}
{{- end }}
{{- define "kvpool.tlsSecret" -}}
{{ .Values.tls.existingSecret | default "kvpool-tls" }}
{{- end }}

{{/* vLLM's arguments for an engine with kvpool's connector in the given role. */}}
{{- define "kvpool.vllmArgs" -}}
- {{ .model }}
- --port
- "8000"
- --kv-transfer-config
- '{"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm", "kv_role": "{{ .role }}", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {}}'
{{- end }}

{{/* What an engine pod needs of its server's node: who it is, where the node is, the key,
and (TLS) the CA and the name the nodes it reaches over TCP prove. */}}
{{- define "kvpool.engineEnv" -}}
- {name: KVPOOL_NODE_NAME, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
- {name: KVPOOL_HOST_ID, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
- name: KVPOOL_ADDRESS
  value: unix:{{ .Values.node.runDir }}/$(KVPOOL_NODE_NAME)/kvpool.sock
{{- end }}

{{/* A client's TLS: the nodes' CA and their certificate's name. */}}
{{- define "kvpool.clientTls" -}}
{{- if .Values.tls.enabled }}
- {name: KVPOOL_TLS_CA, value: /etc/kvpool/tls/ca.crt}
- {name: KVPOOL_TLS_SERVER_NAME, value: {{ .Values.tls.serverName }}}
{{- end }}
{{- end }}
