// The server's API as the page uses it: fetch with the API key (kept in this tab), errors as one line.

export const $ = (id) => document.getElementById(id);
export const FINAL = new Set(["complete", "failed", "cancelled"]);

// key: the one typed (sessionStorage); required: /health says whether /v1 needs one, so none is asked for (no 401)
// before one is typed
export const auth = { key: sessionStorage.getItem("yue2-api-key") || "", required: false };

export function show(element, text) {
  element.textContent = text || "";
  element.hidden = !text;
}

export function headers(extra) {
  const result = Object.assign({}, extra || {});
  if (auth.key) result.Authorization = "Bearer " + auth.key;
  return result;
}

// JSON with each integer past 2**53 kept as written, as a string (seeds go up to 2**63: a number loses digits).
export function parseJson(text) {
  return JSON.parse(text, (key, value, context) => (typeof value === "number" && !Number.isSafeInteger(value)
    && context && /^-?\d+$/.test(context.source) ? context.source : value));
}

export async function api(path, options = {}) {
  const response = await fetch(path, Object.assign({}, options, { headers: headers(options.headers) }));
  const type = response.headers.get("content-type") || "";
  const body = type.includes("application/json") ? parseJson(await response.text()) : await response.text();
  if (!response.ok) {
    const detail = body && body.error ? body.error : {};
    const error = new Error(detail.message || `${response.status} ${response.statusText}`);
    error.status = response.status;
    error.field = detail.field || null;
    error.retryAfter = response.headers.get("retry-after");
    if (response.status === 401) askForKey();
    throw error;
  }
  return body;
}

export function describeError(error) {
  if (error.status === undefined) return `The server did not answer (${error.message}).`;
  let text = `${error.status}: ${error.message}`;
  if (error.status === 429 && error.retryAfter) text += ` Try again in ${error.retryAfter} s.`;
  if (error.status === 401) text += " Enter the API key under Advanced.";
  return text;
}

function askForKey() {
  $("advanced").open = true;
  show($("jobs-error"), auth.key ? "The API key was refused: enter the server's key under Advanced."
                                 : "This server needs its API key: enter it under Advanced.");
}

export function needKey() {  // true (and the key asked for) when /v1 would answer 401
  if (auth.required && !auth.key) { askForKey(); return true; }
  return false;
}

export function saveKey() {
  auth.key = $("api-key").value.trim();
  sessionStorage.setItem("yue2-api-key", auth.key);
}

export async function blobOf(url) {  // a file fetched with the key, for a link or <audio> that cannot send it
  const response = await fetch(url, { headers: headers() });
  if (!response.ok) throw new Error(`${url.split("/").pop()}: ${response.status}`);
  return URL.createObjectURL(await response.blob());
}
