// The snapshot lineage (GET /lineage) as a picture: a tree laid out left to right,
// templates at the roots, then sandboxes, their forks and their snapshots.
import { api } from "./api.js";

const SVG = "http://www.w3.org/2000/svg";
const W = 190, H = 40, DX = 230, DY = 54;

function keep(node) {
  // Gone sandboxes and templates are kept only on the way to something alive.
  const children = (node.children || []).map(keep).filter(Boolean);
  const alive = node.kind === "snapshot" || (node.kind === "sandbox" && node.state !== "gone");
  if (!alive && !children.length) return null;
  return { ...node, children };
}

function layout(roots) {
  const placed = [];
  let row = 0;
  const walk = (node, depth, parent) => {
    const item = { node, depth, parent, y: 0 };
    placed.push(item);
    if (!node.children.length) item.y = row++;
    else {
      const ys = node.children.map((c) => walk(c, depth + 1, item).y);
      item.y = (Math.min(...ys) + Math.max(...ys)) / 2;
    }
    return item;
  };
  for (const r of roots) walk(r, 0, null);
  return { placed, rows: row };
}

function svg(tag, attrs, text) {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
  if (text !== undefined) n.textContent = text;
  return n;
}

const key = (n) => `${n.kind}:${n.id}`;

export async function drawLineage(target) {
  const data = await api("GET", "/lineage");
  const roots = (data.roots || []).map(keep).filter(Boolean);
  if (!roots.length) {
    target.replaceChildren("Nothing yet: create a sandbox.");
    return;
  }
  const { placed, rows } = layout(roots);
  const depth = Math.max(...placed.map((p) => p.depth)) + 1;
  const pic = svg("svg", { width: depth * DX, height: rows * DY, role: "img",
                           "aria-label": "snapshot lineage" });
  const x = (p) => p.depth * DX + 4, y = (p) => p.y * DY + 6;
  for (const p of placed) {
    if (!p.parent) continue;
    const x1 = x(p.parent) + W, y1 = y(p.parent) + H / 2, x2 = x(p), y2 = y(p) + H / 2;
    const mid = (x1 + x2) / 2;
    pic.append(svg("path", { d: `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}`,
                             class: "edge", "data-from": key(p.parent.node), "data-to": key(p.node) }));
  }
  for (const p of placed) {
    const n = p.node;
    const state = n.kind === "sandbox" ? n.state : n.kind === "snapshot" ? (n.snapshotKind || "snapshot") : "";
    const g = svg("g", { class: `node ${n.kind} ${state}`, "data-key": key(n),
                         "data-parent": p.parent ? key(p.parent.node) : "",
                         transform: `translate(${x(p)},${y(p)})` });
    g.append(svg("rect", { width: W, height: H, rx: 6 }));
    const label = n.kind === "snapshot" && n.name ? n.name : n.id;
    const shown = state && state !== n.kind ? ` · ${state}` : "";
    g.append(svg("text", { x: 8, y: 16, class: "kind" }, `${n.kind}${shown}`));
    g.append(svg("text", { x: 8, y: 32, class: "id" }, label.length > 24 ? label.slice(0, 23) + "…" : label));
    g.append(svg("title", {}, `${key(n)}${n.createdAt ? "\ncreated " + n.createdAt : ""}`));
    pic.append(g);
  }
  target.replaceChildren(pic);
}
