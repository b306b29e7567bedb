// Reads a JSON array of Kubernetes objects on stdin; prints one JSON line per object:
// {"kind", "name", "ok", "errors"} using the validators @kubernetes-models/prometheus-operator generates
// from prometheus-operator's Go API types (types, enums, required fields; unknown fields are not rejected).
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const kinds = { PodMonitor, ServiceMonitor, PrometheusRule };
let input = "";
for await (const chunk of process.stdin) input += chunk;
for (const obj of JSON.parse(input)) {
  const Model = kinds[obj.kind];
  const out = { kind: obj.kind, name: obj.metadata?.name ?? null, ok: false, errors: null };
  if (!Model) {
    out.errors = `no validator for kind ${obj.kind}`;
  } else {
    try {
      new Model(obj).validate();
      out.ok = true;
    } catch (e) {
      out.errors = String(e.message ?? e);
    }
  }
  console.log(JSON.stringify(out));
}
