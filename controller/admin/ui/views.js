// The console's views: pure functions from the API's JSON to elements. Every name, reason
// and message goes in as text (dom.js), whatever it holds.

import { chart } from "./charts.js";
import { ago, clock, h, until, utc } from "./dom.js";

const BAD_REPLICA = new Set(["failed", "unhealthy"]);
const BAD_HEALTH = new Set(["unhealthy", "ejected"]);
const ACTIVE = new Set(["progressing", "paused"]);

export const SPAN = 600; // seconds of history charted

/** The newest rollout of the service's own (a rollback is how a failure ended, not news):
 * failed, it is what the service's card says first. */
export function failedRollout(records) {
  const own = (records || []).find((r) => r.kind !== "rollback");
  return own && own.status === "failed" ? own : null;
}

function badge(text, kind) {
  return h("span", { class: `badge badge-${kind}` }, text);
}

function hostOf(address) {
  const m = /^(?:[a-z]+:\/\/)?(\[[^\]]+\]|[^:/]+)/i.exec(address || "");
  return m ? m[1] : "";
}

/** The cluster node a replica runs on: the one whose address has the replica's host. */
export function nodeOf(address, cluster) {
  if (!cluster || !cluster.nodes || !address) return null;
  const host = hostOf(address);
  const node = cluster.nodes.find((n) => hostOf(n.address) === host);
  return node ? node.name : null;
}

function replicaRow(r, cluster) {
  const node = nodeOf(r.address, cluster);
  const bad = BAD_REPLICA.has(r.state) || BAD_HEALTH.has(r.health);
  return h(
    "tr",
    { class: `replica${bad ? " bad" : ""}`,
      dataset: { replica: r.id, state: r.state, health: r.health || "none" } },
    h("td", { class: "mono" }, r.id),
    h("td", null, `r${r.revision}`),
    h("td", null, badge(r.state, r.state)),
    h("td", null, r.health ? badge(r.health, r.health) : h("span", { class: "dim" }, "–")),
    h("td", { class: "num" }, r.inflight),
    h("td", { class: "mono" }, r.address || "–", node ? h("span", { class: "dim" }, ` on ${node}`) : null),
    h("td", { class: "dim", title: utc(r.since) }, ago(r.since)),
    h("td", { class: "reason" },
      r.failure || "", r.exit_code !== null && r.exit_code !== undefined ? ` (exit ${r.exit_code})` : ""),
  );
}

function rolloutPanel(ro) {
  const parts = [`rollout ${ro.id}`, ro.kind !== "rollout" ? ro.kind : null, ro.strategy,
    ro.from_revision ? `r${ro.from_revision} → r${ro.to_revision}` : `r${ro.to_revision}`];
  const weight = ro.weight === null || ro.weight === undefined ? null : ro.weight;
  const bar = h("span", { class: "bar" }, h("span", { class: "fill" }));
  if (weight !== null) bar.firstChild.style.width = `${Math.max(0, Math.min(100, weight))}%`;
  return h(
    "div",
    { class: `rollout rollout-${ro.status}`, dataset: { rollout: ro.id, status: ro.status } },
    h("div", { class: "rollout-head" },
      badge(ro.status, ro.status), " ", parts.filter(Boolean).join(" · "),
      ro.promoted ? h("span", { class: "dim" }, " · promoted") : null,
      h("span", { class: "dim" }, ` · started ${ago(ro.started)}`)),
    ro.step !== null && ro.step !== undefined
      ? h("div", { class: "rollout-step" },
          h("span", { class: "step" }, `step ${ro.step} of ${ro.steps}`),
          weight !== null ? h("span", { class: "weight", dataset: { weight } }, `${weight}%`) : null,
          weight !== null ? bar : null,
          ro.weights && ro.weights.length
            ? h("span", { class: "dim" }, ` steps ${ro.weights.map((w) => `${w}%`).join(" → ")}`)
            : null)
      : null,
    ro.analysis
      ? h("div", { class: "analysis" }, "last analysis: ",
          ro.verdict ? badge(ro.verdict, ro.verdict) : null, " ", h("span", { class: "reason" }, ro.analysis))
      : null,
    h("table", { class: "progress" },
      h("tbody", null, ro.progress.map((p) =>
        h("tr", null, h("td", null, `r${p.revision}`),
          h("td", null, `${p.ready} ready`), h("td", null, `${p.live} live`),
          h("td", { class: "dim" }, p.desired ? `of ${p.desired}` : "old"))))),
    ro.failures ? h("div", { class: "reason" }, `${ro.failures} failed of ${ro.retries} allowed`) : null,
    ro.reason ? h("div", { class: "reason" }, ro.reason) : null,
  );
}

function alerts(svc, failed) {
  const out = [];
  if (failed) {
    out.push(h("div", { class: "alert alert-failed", dataset: { rollout: failed.id } },
      h("strong", null, `rollout ${failed.id} to r${failed.to_revision} failed`),
      failed.finished_at ? ` (${ago(failed.finished_at)})` : "", ": ",
      h("span", { class: "reason" }, failed.reason || "no reason recorded")));
  }
  if (svc.rollout && svc.rollout.status === "paused") {
    out.push(h("div", { class: "alert alert-paused" }, h("strong", null, "paused"),
      svc.rollout.reason ? ": " : "", h("span", { class: "reason" }, svc.rollout.reason || "")));
  }
  if (svc.conditions && svc.conditions.degraded) {
    out.push(h("div", { class: "alert alert-degraded" }, h("strong", null, "degraded"), ": ",
      h("span", { class: "reason" }, svc.conditions.reason || "")));
  }
  if (svc.backoff) {
    const b = svc.backoff;
    out.push(h("div", { class: "alert alert-backoff" },
      `backing off: ${b.failures} failure${b.failures === 1 ? "" : "s"} in a row, next start ${until(b.retry_at)}`,
      b.reason ? ": " : "", h("span", { class: "reason" }, b.reason || "")));
  }
  return out;
}

function pct(v) {
  return v < 0.1 && v > 0 ? `${(v * 100).toFixed(2)}%` : `${(v * 100).toFixed(1)}%`;
}

function ms(v) {
  return v < 0.01 ? `${(v * 1000).toFixed(2)}ms` : v < 1 ? `${(v * 1000).toFixed(0)}ms` : `${v.toFixed(2)}s`;
}

/** A service's charts: requests a second, errors, latency, and its held and queued requests. */
export function chartsView(points, now) {
  const pick = (key) => points.map((p) => ({ t: p.t, v: p[key] }));
  const last = points.length ? points[points.length - 1] : null;
  return h("div", { class: "metrics" },
    chart({ title: "req/s", series: [{ name: "rps", points: pick("rps") }], span: SPAN, now,
      format: (v) => (v < 10 ? v.toFixed(2) : v.toFixed(0)) }),
    chart({ title: "errors", series: [{ name: "errors", points: pick("errorRate") }], span: SPAN,
      now, format: pct, floor: 0.01 }),
    chart({ title: "latency", series: [{ name: "p50", points: pick("p50") },
      { name: "p99", points: pick("p99") }], span: SPAN, now, format: ms, floor: 0.005 }),
    h("div", { class: "queues" },
      h("div", null, "held ", h("strong", { class: "held" }, last ? last.held : "–")),
      h("div", null, "queued ", h("strong", { class: "queued" }, last ? last.queued : "–"))),
  );
}

/** One service's card (its charts are added by the caller). Its buttons call
 * ``act(svc, action)``. */
export function serviceCard(svc, { rollouts, cluster, act }) {
  const failed = failedRollout(rollouts);
  const ro = svc.rollout;
  const active = ro && ACTIVE.has(ro.status);
  const button = (action, label, enabled, why) =>
    h("button", { type: "button", class: `action action-${action}`, dataset: { action },
      disabled: !enabled, title: enabled ? null : why, onclick: () => act(svc, action) }, label);
  const autoscaled = !!svc.autoscaling;
  return h(
    "section",
    { class: `service status-${svc.status}${failed ? " has-failure" : ""}`,
      dataset: { service: svc.name, status: svc.status } },
    h("header", { class: "service-head" },
      h("h3", { class: "service-name" }, svc.name),
      badge(svc.status, svc.status),
      h("span", { class: "revisions" },
        svc.serving_revision === svc.target_revision
          ? `r${svc.target_revision}`
          : `serving ${svc.serving_revision ? `r${svc.serving_revision}` : "none"} · target r${svc.target_revision}`),
      h("span", { class: "ready", dataset: { ready: svc.ready, desired: svc.desired } },
        `${svc.ready}/${svc.desired} ready`),
      autoscaled
        ? h("span", { class: "dim" },
            `autoscaled ${svc.autoscaling.min}..${svc.autoscaling.max} on ${svc.autoscaling.metric}`)
        : null,
      h("span", { class: "actions" },
        button("promote", "Promote", active, "no rollout in progress"),
        button("pause", "Pause", active && ro.status === "progressing", "no rollout progressing"),
        button("resume", "Resume", active && ro.status === "paused", "no rollout paused"),
        button("abort", "Abort", active, "no rollout in progress"),
        button("undo", "Undo", true),
        button("scale", "Scale", !autoscaled, "autoscaled: apply another range instead"))),
    alerts(svc, failed),
    ro ? rolloutPanel(ro) : null,
    svc.autoscaling && svc.autoscaling.decision
      ? h("div", { class: "dim" }, "autoscaler: ", svc.autoscaling.decision)
      : null,
    h("table", { class: "replicas" },
      h("thead", null, h("tr", null, ["replica", "rev", "state", "health", "in flight", "address",
        "since", "failure"].map((t) => h("th", null, t)))),
      h("tbody", null, svc.replicas.length
        ? svc.replicas.map((r) => replicaRow(r, cluster))
        : h("tr", null, h("td", { colspan: 8, class: "dim" }, "no replicas")))),
  );
}

export function clusterView(cluster) {
  if (!cluster) return h("p", { class: "dim" }, "–");
  if (cluster.store === "sqlite") return h("p", null, "one node (SQLite state store)");
  return h("div", null,
    cluster.store_reachable ? null
      : h("div", { class: "alert alert-failed" }, "etcd unreachable: ", cluster.store_reason),
    h("table", { class: "nodes" }, h("tbody", null, cluster.nodes.map((n) =>
      h("tr", { class: n.leader ? "leader" : "", dataset: { node: n.name } },
        h("td", null, n.name, n.leader ? badge("leader", "leader") : null),
        h("td", { class: "mono" }, n.address),
        h("td", { class: "num" }, n.replicas === null || n.replicas === undefined ? "" :
          `${n.replicas}${n.capacity ? `/${n.capacity}` : ""} replicas`))))),
    cluster.leader ? null : h("div", { class: "alert alert-failed" }, "no leader"));
}

export function hostsView(hosts) {
  if (!hosts) return h("p", { class: "dim" }, "–");
  return h("table", { class: "hosts" }, h("tbody", null, hosts.map((x) =>
    h("tr", { class: x.reachable ? "" : "bad", dataset: { host: x.name } },
      h("td", null, x.name, " ", h("span", { class: "dim" }, x.backend)),
      h("td", { class: "mono dim" }, x.engine),
      h("td", null, x.reachable ? badge("up", "healthy") : badge("unreachable", "unhealthy")),
      h("td", { class: "num" }, `${x.replicas}${x.capacity === null ? "" : `/${x.capacity}`}`),
      h("td", { class: "reason" }, x.error)))));
}

export function certificatesView(tls, acme) {
  const rows = [];
  const seen = new Set();
  for (const c of (acme && acme.certificates) || []) {
    seen.add(c.name);
    const soon = c.not_after && c.not_after - Date.now() / 1000 < 7 * 86400;
    rows.push(h("tr", { class: c.state === "failing" || soon ? "bad" : "", dataset: { certificate: c.name } },
      h("td", null, c.name), h("td", null, badge(c.state, c.state)),
      h("td", null, c.not_after ? `expires ${until(c.not_after)}` : "–"),
      h("td", { class: "reason" }, c.last_error || (c.next_order ? `next order ${until(c.next_order)}` : ""))));
  }
  for (const c of (tls && tls.certificates) || []) {
    if (seen.has(c.name)) continue;
    const soon = c.not_after - Date.now() / 1000 < 7 * 86400;
    rows.push(h("tr", { class: soon ? "bad" : "", dataset: { certificate: c.name } },
      h("td", null, c.name), h("td", null, badge(c.acme ? "acme" : "file", "ready")),
      h("td", { title: utc(c.not_after) }, `expires ${until(c.not_after)}`),
      h("td", { class: "dim" }, c.names.join(", "))));
  }
  for (const r of (tls && tls.refused) || []) {
    rows.push(h("tr", { class: "bad" }, h("td", null, r.file), h("td", null, badge("refused", "failed")),
      h("td", null, ""), h("td", { class: "reason" }, r.reason)));
  }
  if (!rows.length) {
    const on = (tls && tls.enabled) || (acme && acme.enabled);
    return h("p", { class: "dim" }, on ? "none yet" : "no HTTPS listener");
  }
  return h("table", { class: "certificates" }, h("tbody", null, rows));
}

const BAD_EVENT = /failed|unhealthy|ejected|degraded|unreachable|aborted|drain_timeout/;
const GOOD_EVENT = /ready|healthy|complete|recovered|reachable|issued|renewed|promoted|ejection_ended/;

export function eventRow(e) {
  const tone = BAD_EVENT.test(e.kind) ? "bad" : GOOD_EVENT.test(e.kind) ? "good" : "";
  return h("li", { class: `event ${tone}`, dataset: { id: e.id, service: e.service, kind: e.kind } },
    h("time", { title: utc(e.at) }, clock(e.at)), " ",
    h("span", { class: "event-service" }, e.service), " ",
    h("span", { class: "event-kind" }, e.kind), " ",
    h("span", { class: "event-message" }, e.message));
}
