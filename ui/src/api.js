// The console is a client of the server's own API: the session cookie stands for the
// key, and X-Aenv-UI (which no cross-site form can send) marks the console's calls.
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export async function api(method, path, body) {
  const headers = { "X-Aenv-UI": "1" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 401) {
    window.location.assign("/ui/login");
    throw new ApiError(401, "not logged in");
  }
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!r.ok) throw new ApiError(r.status, (data && data.message) || `HTTP ${r.status}`);
  return data;
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "onclick") node.addEventListener("click", v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

let statusTimer = 0;
export function say(message, isError = false) {
  const s = document.getElementById("status");
  s.textContent = message;
  s.className = isError ? "error" : "";
  clearTimeout(statusTimer);
  if (!isError) statusTimer = setTimeout(() => { s.textContent = ""; }, 6000);
}
