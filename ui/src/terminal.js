// A live terminal: xterm.js over a WebSocket the server bridges to envd's PTY.
import { Terminal } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import "@xterm/xterm/css/xterm.css";

export class Console {
  constructor() {
    this.panel = document.getElementById("terminal-panel");
    this.term = null;
    this.socket = null;
    document.getElementById("terminal-close").addEventListener("click", () => this.close());
    window.addEventListener("resize", () => this.fit());
  }

  open(id) {
    this.close();
    this.panel.hidden = false;
    document.getElementById("terminal-id").textContent = id;
    const term = new Terminal({ cursorBlink: true, fontSize: 14, scrollback: 2000, convertEol: false });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(document.getElementById("terminal"));
    fit.fit();
    this.term = term;
    this.fitAddon = fit;
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const url = `${scheme}://${location.host}/ui/sandboxes/${encodeURIComponent(id)}/terminal?cols=${term.cols}&rows=${term.rows}`;
    const socket = new WebSocket(url);
    socket.binaryType = "arraybuffer";
    this.socket = socket;
    const encoder = new TextEncoder();
    socket.onmessage = (ev) => {
      if (typeof ev.data !== "string") term.write(new Uint8Array(ev.data));
    };
    socket.onclose = (ev) => {
      term.write(`\r\n\x1b[33m[terminal closed${ev.reason ? ": " + ev.reason : ""}]\x1b[0m\r\n`);
      this.panel.dataset.state = "closed";
    };
    socket.onopen = () => { this.panel.dataset.state = "open"; term.focus(); };
    term.onData((d) => { if (socket.readyState === WebSocket.OPEN) socket.send(encoder.encode(d)); });
    term.onBinary((d) => {
      if (socket.readyState !== WebSocket.OPEN) return;
      socket.send(Uint8Array.from(d, (c) => c.charCodeAt(0) & 0xff));
    });
    term.onResize(({ cols, rows }) => {
      if (socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "resize", cols, rows }));
    });
  }

  fit() { if (this.fitAddon) this.fitAddon.fit(); }

  close() {
    if (this.socket) this.socket.close();
    if (this.term) this.term.dispose();
    this.socket = this.term = this.fitAddon = null;
    this.panel.hidden = true;
    delete this.panel.dataset.state;
  }
}
