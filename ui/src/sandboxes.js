// The sandbox table: state, template, age, CPU and memory, and the lifecycle buttons.
import { api, el, say } from "./api.js";

function age(started) {
  const s = Math.max(0, Math.floor((Date.now() - Date.parse(started)) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

const mib = (b) => `${Math.round(b / (1 << 20))}`;

export class Sandboxes {
  constructor(onTerminal, onChange) {
    this.body = document.querySelector("#sandboxes tbody");
    this.onTerminal = onTerminal;
    this.onChange = onChange;
    this.busy = new Set();
  }

  refresh() {
    // A slow answer is not asked for twice, but a refresh asked for meanwhile (after a
    // create, say) gets a load that starts after it: the one in flight may predate it.
    if (this.loading) {
      this.next ??= this.loading.catch(() => {}).then(() => {
        this.next = null;
        return this.refresh();
      });
      return this.next;
    }
    this.loading = this.load().finally(() => { this.loading = null; });
    return this.loading;
  }

  async load() {
    const list = await api("GET", "/v2/sandboxes?state=running&state=paused&limit=100");
    const running = list.filter((s) => s.state === "running").map((s) => s.sandboxID);
    let metrics = {};
    if (running.length) {
      try {
        metrics = (await api("GET", `/sandboxes/metrics?sandbox_ids=${running.map(encodeURIComponent).join(",")}`)).sandboxes || {};
      } catch { metrics = {}; }
    }
    this.render(list, metrics);
  }

  render(list, metrics) {
    const rows = list.map((s) => {
      const m = metrics[s.sandboxID];
      const cpu = m ? `${m.cpuUsedPct.toFixed(1)}% of ${s.cpuCount}` : `${s.cpuCount} CPU`;
      const mem = m ? `${mib(m.memUsed)} / ${mib(m.memTotal)} MiB` : `${s.memoryMB} MiB`;
      const id = s.sandboxID;
      const act = (label, fn, enabled = true) => {
        const b = el("button", { type: "button", "data-action": label.toLowerCase() }, label);
        b.disabled = !enabled || this.busy.has(id);
        b.addEventListener("click", () => this.run(id, label, fn));
        return b;
      };
      const on = s.state === "running";
      return el("tr", { "data-id": id, "data-state": s.state },
        el("td", {}, el("code", {}, id)), el("td", { class: `state ${s.state}` }, s.state),
        el("td", {}, s.alias || s.templateID), el("td", {}, age(s.startedAt)),
        el("td", {}, cpu), el("td", {}, mem),
        el("td", { class: "actions" },
          act("Terminal", async () => this.onTerminal(id), on),
          act("Pause", () => api("POST", `/sandboxes/${id}/pause`, {}), on),
          act("Resume", () => api("POST", `/sandboxes/${id}/resume`, {}), !on),
          act("Fork", async () => {
            const [child] = await api("POST", `/sandboxes/${id}/fork`, { count: 1 });
            if (child.error) throw new Error(child.error.message);
            return `forked into ${child.sandbox.sandboxID}`;
          }, on),
          act("Snapshot", async () => {
            const snap = await api("POST", `/sandboxes/${id}/snapshots`, {});
            return `snapshot ${snap.snapshotID}`;
          }, on),
          act("Kill", () => api("DELETE", `/sandboxes/${id}`))));
    });
    this.body.replaceChildren(...rows);
    if (!rows.length) this.body.append(el("tr", {}, el("td", { colspan: "7", class: "empty" }, "No sandboxes")));
  }

  async run(id, label, fn) {
    this.busy.add(id);
    say(`${label} ${id}…`);
    try {
      const done = await fn();
      say(typeof done === "string" ? done : `${label} ${id}: done`);
    } catch (e) {
      say(`${label} ${id}: ${e.message}`, true);
    } finally {
      this.busy.delete(id);
      await this.onChange();
    }
  }

  async create(template) {
    say(`creating a sandbox of ${template}…`);
    try {
      const s = await api("POST", "/sandboxes", { templateID: template, timeout: 900 });
      say(`created ${s.sandboxID}`);
    } catch (e) {
      say(`create: ${e.message}`, true);
    }
    await this.onChange();
  }
}
