// The console: what the admin API says, kept current by its event stream.
//
// Each event refreshes what it concerns (its service, the hosts, the certificates) within
// 100 ms, and a health transition marks its replica's row at once, before that refresh
// lands. Every TICK the page also scrapes /metrics for the charts and refreshes what has no
// event of its own (in-flight counts, the cluster's nodes): never faster.

import { ApiError, api, follow, metricsText, service, token } from "./api.js";
import { fill, h } from "./dom.js";
import { parse, rates, snapshot } from "./metrics.js";
import {
  SPAN,
  certificatesView,
  chartsView,
  clusterView,
  eventRow,
  hostsView,
  serviceCard,
} from "./views.js";

const TICK = 5000;
const SETTLE = 100; // ms: events that come together cost one refresh
const MAX_EVENTS = 500;
const HEALTH = { upstream_unhealthy: "unhealthy", upstream_healthy: "healthy", upstream_ejected: "ejected" };

const $ = (id) => document.getElementById(id);

const state = {
  auth: "unknown", // "none": no token configured; "ok"; "needed"; "refused"
  services: new Map(), // name -> the API's view
  applied: new Map(), // name -> the sequence number of the fetch shown
  rollouts: new Map(), // name -> its latest rollout records
  points: new Map(), // name -> [{t, rps, errorRate, p50, p99, held, queued}]
  scrape: null, // {t, snap}: the last /metrics
  cards: new Map(), // name -> {el, body, charts, key}
  events: [],
  hosts: null,
  cluster: null,
  tls: null,
  acme: null,
  error: "",
};
let seq = 0;
let stream = null;
let ticker = null;

// -- rendering ---------------------------------------------------------------------------

const dirty = new Set();
let flushing = false;

function markDirty(name) {
  dirty.add(name);
  if (!flushing) {
    flushing = true;
    queueMicrotask(flush);
  }
}

function flush() {
  flushing = false;
  for (const name of dirty) renderService(name);
  dirty.clear();
  renderServiceOrder();
}

function renderService(name) {
  const svc = state.services.get(name);
  const card = state.cards.get(name);
  if (!svc) {
    if (card) card.el.remove();
    state.cards.delete(name);
    return;
  }
  const rollouts = state.rollouts.get(name) || [];
  const nodes = state.cluster && state.cluster.nodes.map((n) => [n.name, n.address]);
  const key = JSON.stringify([svc, rollouts, nodes, Math.floor(Date.now() / 30000)]);
  if (card && card.key === key) return;
  const body = serviceCard(svc, { rollouts, cluster: state.cluster, act });
  const charts = card ? card.charts : h("div", { class: "charts-slot" });
  body.insertBefore(charts, body.querySelector("table.replicas"));
  if (!card) renderCharts(name, charts);
  if (card) card.el.replaceWith(body);
  state.cards.set(name, { el: body, charts, key });
}

function renderServiceOrder() {
  const list = $("services");
  const names = [...state.cards.keys()].sort();
  names.forEach((name, i) => {
    const el = state.cards.get(name).el;
    if (list.children[i] !== el) list.insertBefore(el, list.children[i] || null);
  });
  $("services-count").textContent = state.services.size ? `(${state.services.size})` : "";
  if (!state.services.size && state.auth !== "needed" && state.auth !== "refused") {
    if (!list.querySelector(".empty")) list.append(h("p", { class: "dim empty" }, "no services"));
  } else {
    const empty = list.querySelector(".empty");
    if (empty) empty.remove();
  }
  const select = $("events-service");
  const chosen = select.value;
  const known = new Set([...state.services.keys(), ...state.events.map((e) => e.service)]);
  known.delete("");
  const wanted = ["", ...[...known].sort()];
  const have = [...select.options].map((o) => o.value);
  if (JSON.stringify(have) !== JSON.stringify(wanted)) {
    fill(select, wanted.map((v) => h("option", { value: v }, v || "all")));
    select.value = wanted.includes(chosen) ? chosen : "";
  }
}

function renderCharts(name, slot) {
  fill(slot, chartsView(state.points.get(name) || [], Date.now() / 1000));
}

function renderOverview() {
  fill($("cluster"), clusterView(state.cluster));
  fill($("hosts"), hostsView(state.hosts));
  fill($("certificates"), certificatesView(state.tls, state.acme));
}

function notice(kind, id, ...text) {
  return h("div", { class: `notice notice-${kind}`, id }, ...text);
}

function renderNotices() {
  const out = [];
  if (state.auth === "none") {
    out.push(notice("warn", "no-token",
      "No admin token is configured: anyone who can reach this listener can read and change "
      + "the gateway. Set admin.token_env or admin.token_file."));
  } else if (state.auth === "needed") {
    out.push(notice("info", "token-needed",
      "The admin API needs its token: enter it above. It is kept for this tab only."));
  } else if (state.auth === "refused") {
    out.push(notice("bad", "token-refused", "The admin API refused this token."));
  }
  if (state.error) out.push(notice("bad", "load-error", state.error));
  fill($("notices"), out);
  $("token-forget").disabled = !token.get();
}

function matches(e) {
  const service = $("events-service").value;
  const text = $("events-text").value.trim().toLowerCase();
  if (service && e.service !== service) return false;
  if (text && !`${e.kind} ${e.message}`.toLowerCase().includes(text)) return false;
  return true;
}

function renderEvents() {
  fill($("events"), state.events.filter(matches).reverse().slice(0, 200).map(eventRow));
}

function toast(text, tone = "") {
  const el = h("div", { class: `toast ${tone}`, role: "status" }, text);
  $("toasts").append(el);
  setTimeout(() => el.remove(), 10000);
  while ($("toasts").children.length > 4) $("toasts").firstChild.remove();
}

// -- loading -----------------------------------------------------------------------------

function refused(error) {
  if (error instanceof ApiError && error.status === 401) {
    state.auth = token.get() ? "refused" : "needed";
    renderNotices();
    return true;
  }
  return false;
}

function show(svc, n) {
  if ((state.applied.get(svc.name) || 0) > n) return; // a newer answer is shown already
  state.applied.set(svc.name, n);
  state.services.set(svc.name, svc);
  markDirty(svc.name);
}

function forget(name, n) {
  if ((state.applied.get(name) || 0) > n) return;
  state.applied.set(name, n);
  state.services.delete(name);
  state.rollouts.delete(name);
  markDirty(name);
}

async function loadServices() {
  const n = ++seq;
  const { services } = await api("GET", "/api/services");
  const names = new Set(services.map((s) => s.name));
  for (const svc of services) show(svc, n);
  for (const name of [...state.services.keys()]) if (!names.has(name)) forget(name, n);
  return services;
}

async function loadService(name) {
  const n = ++seq;
  try {
    show(await api("GET", service(name)), n);
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) forget(name, n);
    else throw error;
  }
}

async function loadRollouts(name) {
  try {
    const { rollouts } = await api("GET", `${service(name)}/rollouts?limit=5`);
    state.rollouts.set(name, rollouts);
    markDirty(name);
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 404)) throw error;
  }
}

async function optional(path) {
  try {
    return await api("GET", path);
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) return null; // not mounted here
    throw error;
  }
}

async function loadHosts() {
  state.hosts = (await api("GET", "/api/hosts")).hosts;
  renderOverview();
}

async function loadCluster() {
  state.cluster = await optional("/api/cluster");
  renderOverview();
  for (const name of state.services.keys()) markDirty(name); // the replicas' nodes
}

async function loadCertificates() {
  [state.tls, state.acme] = await Promise.all([optional("/api/tls"), optional("/api/certificates")]);
  renderOverview();
}

async function guard(work) {
  try {
    await work();
    if (state.error) {
      state.error = "";
      renderNotices();
    }
  } catch (error) {
    if (refused(error)) return;
    state.error = `The admin API did not answer: ${error.message}`;
    renderNotices();
  }
}

async function loadAll() {
  await guard(async () => {
    const services = await loadServices();
    if (state.auth !== "none") state.auth = "ok";
    await Promise.all([
      ...services.map((s) => loadRollouts(s.name)),
      loadHosts(),
      loadCluster(),
      loadCertificates(),
    ]);
  });
  renderNotices();
}

// Refreshes asked by events, each run once per SETTLE however many events asked for it.
const pending = new Map();

function soon(key, work) {
  if (pending.has(key)) return;
  pending.set(key, setTimeout(() => {
    pending.delete(key);
    guard(work);
  }, SETTLE));
}

function onEvent(e) {
  if (state.events.some((seen) => seen.id === e.id && seen.at === e.at)) return; // sent again
  state.events.push(e);
  if (state.events.length > MAX_EVENTS) state.events.splice(0, state.events.length - MAX_EVENTS);
  if (matches(e)) {
    const list = $("events");
    list.insertBefore(eventRow(e), list.firstChild);
    while (list.children.length > 200) list.lastChild.remove();
  }
  const kind = e.kind || "";
  const name = e.service;
  if (HEALTH[kind] && e.replica && state.services.has(name)) {
    // The row turns now; the refresh below confirms it.
    const svc = state.services.get(name);
    const replicas = svc.replicas.map((r) => (r.id === e.replica ? { ...r, health: HEALTH[kind] } : r));
    state.services.set(name, { ...svc, replicas });
    markDirty(name);
  }
  if (name && !kind.startsWith("host_")) {
    soon(`service:${name}`, () => loadService(name));
    if (kind.startsWith("rollout_") || kind.startsWith("service_")) {
      soon(`rollouts:${name}`, () => loadRollouts(name));
    }
  }
  if (kind.startsWith("host_") || kind.startsWith("replica_")) soon("hosts", loadHosts);
  if (kind.startsWith("certificate_")) soon("certificates", loadCertificates);
}

async function tick() {
  if (document.hidden) return;
  try {
    const text = await metricsText();
    const now = Date.now() / 1000;
    const snap = snapshot(parse(text));
    if (state.scrape) {
      const window = now - state.scrape.t;
      for (const [name, point] of rates(state.scrape.snap, snap, window)) {
        const points = state.points.get(name) || [];
        points.push({ t: now, ...point });
        while (points.length && points[0].t < now - SPAN) points.shift();
        state.points.set(name, points);
      }
    }
    for (const name of state.services.keys()) {
      if (snap.has(name) || !state.scrape) continue; // no request yet: none a second
      const points = state.points.get(name) || [];
      points.push({ t: now, rps: 0, errorRate: null, p50: null, p99: null, held: 0, queued: 0 });
      while (points.length && points[0].t < now - SPAN) points.shift();
      state.points.set(name, points);
    }
    state.scrape = { t: now, snap };
    for (const [name, card] of state.cards) renderCharts(name, card.charts);
  } catch {
    // the charts wait for the next tick
  }
  if (state.auth !== "needed" && state.auth !== "refused") {
    guard(async () => {
      await Promise.all([loadServices(), loadHosts(), loadCluster()]);
    });
  }
}

// -- actions -----------------------------------------------------------------------------

const ACTIONS = {
  promote: { path: "rollout/promote", verb: "Promote" },
  pause: { path: "rollout/pause", verb: "Pause" },
  resume: { path: "rollout/resume", verb: "Resume" },
  abort: { path: "rollout/abort", verb: "Abort" },
  undo: { path: "rollout/undo", verb: "Undo" },
  scale: { path: "scale", verb: "Scale" },
};

function question(svc, action) {
  const ro = svc.rollout;
  const which = ro ? `rollout ${ro.id} of ${svc.name} (r${ro.from_revision ?? "–"} → r${ro.to_revision})` : svc.name;
  switch (action) {
    case "promote":
      return `Promote ${which}: skip its remaining steps and give revision ${ro ? ro.to_revision : "?"} all the traffic?`;
    case "pause":
      return `Pause ${which}? Nothing is started or drained until it is resumed.`;
    case "resume":
      return `Resume ${which}? Its retries and deadline start afresh.`;
    case "abort":
      return `Abort ${which} and return to revision ${ro ? ro.from_revision : "?"}?`;
    case "undo":
      return `Roll ${svc.name} back to the revision before r${svc.target_revision}, as a new rollout?`;
    default:
      return `Scale ${svc.name} (now ${svc.desired} desired) to how many replicas?`;
  }
}

function confirmAction(svc, action) {
  const dialog = $("confirm");
  $("confirm-title").textContent = `${ACTIONS[action].verb} ${svc.name}`;
  $("confirm-text").textContent = question(svc, action);
  const field = $("confirm-field");
  field.hidden = action !== "scale";
  $("confirm-number").value = String(svc.desired);
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
    (action === "scale" ? $("confirm-number") : $("confirm-ok")).focus();
  });
}

async function act(svc, action) {
  if (!(await confirmAction(svc, action))) return;
  const { path, verb } = ACTIONS[action];
  let body;
  if (action === "scale") {
    const replicas = Number($("confirm-number").value);
    if (!Number.isInteger(replicas) || replicas < 0) {
      toast(`${verb} ${svc.name}: not a replica count: ${$("confirm-number").value}`, "bad");
      return;
    }
    body = { replicas };
  }
  try {
    const result = await api("POST", `${service(svc.name)}/${path}`, body);
    const what = action === "scale"
      ? `${result.action}, revision ${result.revision}`
      : `rollout ${result.id} ${result.status}`;
    toast(`${verb} ${svc.name}: ${what}`, "good");
  } catch (error) {
    refused(error);
    const status = error instanceof ApiError ? ` (${error.status})` : "";
    toast(`${verb} ${svc.name} refused${status}: ${error.message}`, "bad");
  }
  soon(`service:${svc.name}`, () => loadService(svc.name));
  soon(`rollouts:${svc.name}`, () => loadRollouts(svc.name));
}

// -- start -------------------------------------------------------------------------------

function setStream(value) {
  const el = $("stream");
  el.dataset.state = value;
  el.textContent = { live: "live", reconnecting: "reconnecting…", unauthorized: "no access",
    connecting: "connecting" }[value] || value;
  if (value === "unauthorized") {
    state.auth = token.get() ? "refused" : "needed";
    renderNotices();
  }
}

function clear() {
  for (const name of [...state.services.keys()]) forget(name, ++seq);
  state.hosts = state.cluster = state.tls = state.acme = null;
  state.events = [];
  renderEvents();
  renderOverview();
}

async function start() {
  if (stream) stream.stop();
  setStream("connecting");
  // Whether this listener has a token at all: the same read, without one.
  try {
    await api("GET", "/api/hosts", undefined, { auth: false });
    state.auth = "none";
  } catch (error) {
    state.auth = error instanceof ApiError && error.status === 401
      ? (token.get() ? "ok" : "needed")
      : "unknown";
  }
  renderNotices();
  if (state.auth === "needed") {
    setStream("unauthorized");
    return;
  }
  stream = follow({ onEvent, onState: setStream, onOpen: loadAll });
  if (!ticker) ticker = setInterval(tick, TICK);
  tick();
}

$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = $("token-input");
  token.set(input.value.trim());
  input.value = "";
  clear();
  start();
});
$("token-forget").addEventListener("click", () => {
  token.set("");
  if (stream) stream.stop();
  clear();
  start();
});
$("events-service").addEventListener("change", renderEvents);
$("events-text").addEventListener("input", renderEvents);

start();
