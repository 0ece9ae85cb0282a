// Small inline SVG line charts: no library. A series is [{t, v}] (v null: no data).

import { h, s } from "./dom.js";

const WIDTH = 180;
const HEIGHT = 40;

function path(points, t0, t1, top) {
  let d = "";
  let pen = false;
  for (const { t, v } of points) {
    if (v === null || v === undefined || !Number.isFinite(v)) {
      pen = false;
      continue;
    }
    const x = ((t - t0) / Math.max(1, t1 - t0)) * WIDTH;
    const y = HEIGHT - 2 - (v / top) * (HEIGHT - 4);
    d += `${pen ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
    pen = true;
  }
  return d;
}

/**
 * A chart of one or more series over the window [now - span, now], with a caption: its
 * title and each series' latest value, formatted by ``format``.
 */
export function chart({ title, series, span, now, format, floor = 0 }) {
  const t0 = now - span;
  let top = floor;
  for (const { points } of series) {
    for (const { v } of points) if (v !== null && Number.isFinite(v)) top = Math.max(top, v);
  }
  top = top > 0 ? top * 1.1 : 1;
  const svg = s(
    "svg",
    { class: "chart", viewBox: `0 0 ${WIDTH} ${HEIGHT}`, width: WIDTH, height: HEIGHT,
      role: "img", "aria-label": title },
    s("line", { class: "axis", x1: 0, y1: HEIGHT - 1, x2: WIDTH, y2: HEIGHT - 1 }),
    series.map(({ name, points }) =>
      s("path", { class: `line line-${name}`, d: path(points.filter((p) => p.t >= t0), t0, now, top) }),
    ),
  );
  const latest = series.map(({ name, points }) => {
    const last = points.length ? points[points.length - 1].v : null;
    return h("span", { class: `value value-${name}`, dataset: { series: name } },
      series.length > 1 ? `${name} ` : "", last === null || last === undefined ? "–" : format(last));
  });
  return h("figure", { class: "metric" },
    h("figcaption", null, h("span", { class: "metric-title" }, title), " ", latest), svg);
}
