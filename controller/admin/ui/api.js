// The admin API, with the token the user entered: kept in sessionStorage (this tab only),
// sent as a bearer header, never in a URL and never in a cookie (credentials: "omit").

const KEY = "gateway-admin-token";

export const token = {
  get: () => sessionStorage.getItem(KEY) || "",
  set(value) {
    if (value) sessionStorage.setItem(KEY, value);
    else sessionStorage.removeItem(KEY);
  },
};

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers(extra) {
  const out = { ...extra };
  const value = token.get();
  if (value) out.Authorization = `Bearer ${value}`;
  return out;
}

const BASE = { cache: "no-store", credentials: "omit", redirect: "error" };

/** Call the API; answers the JSON body, throws ApiError with the API's code and message. */
export async function api(method, path, body, { auth = true } = {}) {
  const init = { ...BASE, method, headers: auth ? headers({ Accept: "application/json" }) : {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    throw new ApiError(
      response.status,
      (data && data.error) || `http_${response.status}`,
      (data && data.message) || response.statusText,
    );
  }
  return data;
}

export const service = (name) => `/api/services/${encodeURIComponent(name)}`;

/** Prometheus text exposition of /metrics (open, no token). */
export async function metricsText() {
  const response = await fetch("/metrics", { ...BASE, headers: { Accept: "text/plain" } });
  if (!response.ok) throw new ApiError(response.status, `http_${response.status}`, "metrics");
  return response.text();
}

/**
 * Follow /api/events: server-sent events read with fetch (EventSource cannot send a bearer
 * header), reconnecting with Last-Event-ID after a break. ``onEvent(entry)`` gets each
 * entry, ``onState(state)`` "live", "reconnecting" or "unauthorized" (then it stops until
 * ``restart``). The first connection asks for the history the gateway holds (Last-Event-ID 0).
 */
export function follow({ onEvent, onState, onOpen }) {
  let last = 0;
  let stopped = false;
  let abort = null;

  function parse(block) {
    let id = null;
    let kind = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "id") id = value;
      else if (field === "event") kind = value;
      else if (field === "data") data.push(value);
    }
    if (!data.length) return;
    if (id !== null && /^\d+$/.test(id)) last = Number(id);
    let entry;
    try {
      entry = JSON.parse(data.join("\n"));
    } catch {
      return;
    }
    onEvent(entry, kind);
  }

  async function run() {
    let delay = 500;
    while (!stopped) {
      abort = new AbortController();
      try {
        const response = await fetch("/api/events", {
          ...BASE,
          headers: headers({ Accept: "text/event-stream", "Last-Event-ID": String(last) }),
          signal: abort.signal,
        });
        if (response.status === 401) {
          onState("unauthorized");
          return;
        }
        if (!response.ok) throw new Error(`HTTP ${response.status}`);
        onState("live");
        onOpen();
        delay = 500;
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value.replace(/\r\n?/g, "\n");
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            parse(buffer.slice(0, end));
            buffer = buffer.slice(end + 2);
          }
        }
      } catch {
        // a break: reconnect below
      }
      if (stopped) return;
      onState("reconnecting");
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(delay * 2, 8000);
    }
  }

  run();
  return {
    stop() {
      stopped = true;
      if (abort) abort.abort();
    },
  };
}
