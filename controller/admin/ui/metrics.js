// What the console charts, from the gateway's own /metrics: requests a second, the share of
// 5xx answers, and p50/p99 latency per service, each between two scrapes. Pure functions:
// text in, numbers out.

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;

function labels(text) {
  const out = {};
  let i = 0;
  while (i < text.length) {
    const eq = text.indexOf("=", i);
    if (eq < 0) break;
    const name = text.slice(i, eq).replace(/^[\s,]+/, "").trim();
    let j = eq + 2; // past ="
    let value = "";
    while (j < text.length && text[j] !== '"') {
      if (text[j] === "\\" && j + 1 < text.length) {
        const next = text[j + 1];
        value += next === "n" ? "\n" : next;
        j += 2;
      } else {
        value += text[j];
        j += 1;
      }
    }
    out[name] = value;
    i = j + 1;
  }
  return out;
}

/** Every sample of a text exposition: {name, labels, value}. */
export function parse(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = SAMPLE.exec(line);
    if (!m) continue;
    const value = m[3] === "+Inf" ? Infinity : Number(m[3]);
    samples.push({ name: m[1], labels: m[2] ? labels(m[2]) : {}, value });
  }
  return samples;
}

function entry(out, service) {
  if (!out.has(service)) {
    out.set(service, { total: 0, errors: 0, buckets: new Map(), held: 0, queued: 0 });
  }
  return out.get(service);
}

/** Per service: requests and 5xx answers so far, latency buckets (summed over revisions),
 * requests held and queued now. */
export function snapshot(samples) {
  const out = new Map();
  for (const { name, labels: l, value } of samples) {
    if (!l.service) continue;
    if (name === "gateway_requests_total") {
      const e = entry(out, l.service);
      e.total += value;
      if (String(l.code).startsWith("5")) e.errors += value;
    } else if (name === "gateway_request_duration_seconds_bucket") {
      const e = entry(out, l.service);
      const le = l.le === "+Inf" ? Infinity : Number(l.le);
      e.buckets.set(le, (e.buckets.get(le) || 0) + value);
    } else if (name === "gateway_service_held_requests") {
      entry(out, l.service).held += value;
    } else if (name === "gateway_service_queued_requests") {
      entry(out, l.service).queued += value;
    }
  }
  return out;
}

/** The q-quantile of a histogram's cumulative buckets (Map le -> count), as Prometheus'
 * histogram_quantile: linear within the bucket; in the +Inf bucket, its lower bound. */
export function quantile(q, buckets) {
  const bounds = [...buckets.keys()].sort((a, b) => a - b);
  if (!bounds.length) return null;
  const total = buckets.get(bounds[bounds.length - 1]);
  if (!total) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const bound of bounds) {
    const count = buckets.get(bound);
    if (count >= rank) {
      if (bound === Infinity) return lower;
      const inside = count - below;
      return inside > 0 ? lower + ((bound - lower) * (rank - below)) / inside : bound;
    }
    lower = bound;
    below = count;
  }
  return lower;
}

/** Between two snapshots ``seconds`` apart: per service {rps, errorRate, p50, p99, held,
 * queued}; a service whose counters went back (a restart) has no rates for that interval. */
export function rates(before, after, seconds) {
  const out = new Map();
  for (const [service, now] of after) {
    const was = before.get(service) || { total: 0, errors: 0, buckets: new Map() };
    const requests = now.total - was.total;
    const point = { rps: null, errorRate: null, p50: null, p99: null, held: now.held,
      queued: now.queued };
    if (requests >= 0 && seconds > 0) {
      point.rps = requests / seconds;
      if (requests > 0) {
        point.errorRate = (now.errors - was.errors) / requests;
        const delta = new Map();
        for (const [le, count] of now.buckets) delta.set(le, count - (was.buckets.get(le) || 0));
        point.p50 = quantile(0.5, delta);
        point.p99 = quantile(0.99, delta);
      }
    }
    out.set(service, point);
  }
  return out;
}
