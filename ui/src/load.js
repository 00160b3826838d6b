// Node load over the last minutes (GET /load): CPU, memory, sandboxes, as plots.
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import { api } from "./api.js";

const GIB = 1 << 30;

export class Load {
  constructor(target) {
    this.target = target;
    this.plots = null;
  }

  async refresh() {
    const data = await api("GET", "/load");
    const s = data.samples || [];
    const t = s.map((p) => p.t);
    const series = [
      [t, s.map((p) => p.cpuPct)],
      [t, s.map((p) => p.memUsedBytes / GIB)],
      [t, s.map((p) => p.running), s.map((p) => p.paused)],
    ];
    document.getElementById("load-note").textContent =
      `${data.cpus} CPUs, ${s.length ? (s[s.length - 1].memTotalBytes / GIB).toFixed(1) : "?"} GiB; a sample every ${data.intervalSeconds} s`;
    if (!this.plots) this.plots = this.make(series);
    else this.plots.forEach((plot, i) => plot.setData(series[i]));
  }

  make(series) {
    const width = Math.max(280, Math.min(420, (this.target.clientWidth || 900) / 3 - 16));
    const opts = (title, labels, colors, range) => ({
      title, width, height: 170,
      scales: { y: range ? { range } : {} },
      series: [{}, ...labels.map((label, i) => ({ label, stroke: colors[i], width: 2 }))],
      axes: [{ stroke: "#9aa7b4" }, { stroke: "#9aa7b4" }],
    });
    const defs = [
      opts("CPU %", ["cpu %"], ["#2f81f7"], [0, 100]),
      opts("Memory used (GiB)", ["used"], ["#3fb950"]),
      opts("Sandboxes", ["running", "paused"], ["#d29922", "#a371f7"],
           (u, min, max) => [0, Math.max(4, Math.ceil(max * 1.2))]),
    ];
    return defs.map((o, i) => {
      const box = document.createElement("div");
      box.className = "plot";
      box.dataset.plot = String(i);
      this.target.append(box);
      return new uPlot(o, series[i], box);
    });
  }
}
