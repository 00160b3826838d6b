import "./style.css";
import { say } from "./api.js";
import { Sandboxes } from "./sandboxes.js";
import { Console } from "./terminal.js";
import { drawLineage } from "./lineage.js";
import { Load } from "./load.js";

const terminal = new Console();
const lineageBox = document.getElementById("lineage");
const load = new Load(document.getElementById("load"));

async function refreshAll() {
  const jobs = [sandboxes.refresh(), drawLineage(lineageBox), load.refresh()];
  for (const r of await Promise.allSettled(jobs)) {
    if (r.status === "rejected") say(r.reason.message, true);
  }
}

const sandboxes = new Sandboxes((id) => terminal.open(id), refreshAll);

document.getElementById("create-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sandboxes.create(document.getElementById("template").value.trim() || "base");
});
document.getElementById("logout").addEventListener("click", async () => {
  await fetch("/ui/logout", { method: "POST", headers: { "X-Aenv-UI": "1" }, credentials: "same-origin" });
  window.location.assign("/ui/login");
});
document.getElementById("server").textContent = location.host;

refreshAll();
setInterval(() => sandboxes.refresh().catch((e) => say(e.message, true)), 3000);
setInterval(() => Promise.allSettled([drawLineage(lineageBox), load.refresh()]), 10000);
window.aenvConsole = { refreshAll };
