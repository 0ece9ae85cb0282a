// Small inline SVG line charts: no library. A series is [{t, v}] (v null: no data).

import { h, s } from "./dom.js";

const WIDTH = 180;
const HEIGHT = 40;

function xy(t, v, t0, t1, top) {
  const x = ((t - t0) / Math.max(1, t1 - t0)) * (WIDTH - 3) + 1;
  const y = HEIGHT - 3 - (v / top) * (HEIGHT - 6);
  return [x.toFixed(1), y.toFixed(1)];
}

const known = (v) => v !== null && v !== undefined && Number.isFinite(v);

function path(points, t0, t1, top) {
  let d = "";
  let pen = false;
  for (const { t, v } of points) {
    if (!known(v)) {
      pen = false;
      continue;
    }
    const [x, y] = xy(t, v, t0, t1, top);
    d += `${pen ? "L" : "M"}${x},${y}`;
    pen = true;
  }
  return d;
}

function dot(name, points, t0, t1, top) {
  const last = points[points.length - 1];
  if (!last || !known(last.v)) return null;
  const [cx, cy] = xy(last.t, last.v, t0, t1, top);
  return s("circle", { class: `dot dot-${name}`, cx, cy, r: 2 });
}

/**
 * A chart of one or more series over at most the window [now - span, now], with a caption: its
 * title and each series' latest value, formatted by ``format``.
 */
export function chart({ title, series, span, now, format, floor = 0 }) {
  // The window grows with the history kept, up to ``span``: a new page's first points are
  // not squeezed into the right edge.
  const first = Math.min(...series.map(({ points }) => (points.length ? points[0].t : now)));
  const t0 = Math.max(now - span, Math.min(first, now - 30));
  let top = floor;
  for (const { points } of series) {
    for (const { v } of points) if (v !== null && Number.isFinite(v)) top = Math.max(top, v);
  }
  top = top > 0 ? top * 1.1 : 1;
  const svg = s(
    "svg",
    { class: "chart", dataset: { points: series[0].points.length }, viewBox: `0 0 ${WIDTH} ${HEIGHT}`, width: WIDTH, height: HEIGHT,
      role: "img", "aria-label": title },
    s("line", { class: "axis", x1: 0, y1: HEIGHT - 1, x2: WIDTH, y2: HEIGHT - 1 }),
    series.map(({ name, points }) => {
      const shown = points.filter((p) => p.t >= t0);
      return [
        s("path", { class: `line line-${name}`, d: path(shown, t0, now, top) }),
        dot(name, shown, t0, now, top),
      ];
    }),
  );
  const latest = series.map(({ name, points }) => {
    const last = points.length ? points[points.length - 1].v : null;
    return h("span", { class: `value value-${name}`, dataset: { series: name } },
      series.length > 1 ? `${name} ` : "", last === null || last === undefined ? "–" : format(last));
  });
  return h("figure", { class: "metric" },
    h("figcaption", null, h("span", { class: "metric-title" }, title), " ", latest), svg);
}
