// Building the page from data: every value the API returns becomes a text node or a
// property, never markup. Nothing here parses HTML (no innerHTML, no insertAdjacentHTML).

const SVG = "http://www.w3.org/2000/svg";

function build(el, props, children) {
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.setAttribute("class", value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : String(child)); // a string is a text node
  }
  return el;
}

/** An HTML element: h("td", {class: "x"}, "text", otherElement). */
export function h(tag, props, ...children) {
  return build(document.createElement(tag), props, children);
}

/** An SVG element, the same way. */
export function s(tag, props, ...children) {
  return build(document.createElementNS(SVG, tag), props, children);
}

/** Replace what ``el`` holds. */
export function fill(el, ...children) {
  el.replaceChildren();
  return build(el, null, children);
}

export function ago(seconds) {
  const d = Math.max(0, Date.now() / 1000 - seconds);
  if (d < 60) return `${Math.floor(d)}s ago`;
  if (d < 3600) return `${Math.floor(d / 60)}m ago`;
  if (d < 86400) return `${Math.floor(d / 3600)}h ago`;
  return `${Math.floor(d / 86400)}d ago`;
}

export function until(seconds) {
  const d = seconds - Date.now() / 1000;
  if (d < 0) return `${ago(seconds).replace(" ago", "")} ago`;
  if (d < 60) return `in ${Math.ceil(d)}s`;
  if (d < 3600) return `in ${Math.ceil(d / 60)}m`;
  if (d < 86400) return `in ${Math.floor(d / 3600)}h`;
  return `in ${Math.floor(d / 86400)}d`;
}

export function clock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString([], { hour12: false });
}

export function utc(seconds) {
  return new Date(seconds * 1000).toISOString().slice(0, 16).replace("T", " ") + " UTC";
}
