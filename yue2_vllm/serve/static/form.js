// The new-song form: its body as the API takes it, submitted once per attempt (an idempotency key), errors shown
// on the field they name.

import { chosenAdapters } from "./adapters.js";
import { $, api, describeError, needKey, saveKey, show } from "./api.js";
import { refreshJobs } from "./jobs.js";
import { select } from "./song.js";
import { takesOf } from "./takes.js";

const FIELDS = {  // an error's field -> the control to mark
  style: "style", tags: "style", lyrics: "lyrics", cot: "cot", seed: "seed", cfg_scale: "cfg_scale", abc: "abc",
  abc_sampling: "abc-temperature", semantic_sampling: "semantic-temperature", stage: "plan-only",
  takes: "takes", best_of: "takes", instrumental: "instrumental", seconds: "seconds", adapters: "adapters-list",
};

let pendingKey = null;  // {body, key}: reused only when the last attempt got no answer at all

export function randomSeed() {
  const words = crypto.getRandomValues(new Uint32Array(2));
  return ((BigInt(words[0] & 0x7fffffff) << 32n) | BigInt(words[1])).toString();
}

// The form as a POST /v1/songs body (JSON text); `overrides` replace its fields (a melody source's score and cot).
export function collect(overrides = {}) {
  const body = { style: $("style").value, lyrics: $("lyrics").value, cot: $("cot").value };
  if ($("seconds").value.trim() !== "") body.seconds = Number($("seconds").value);
  const cfg = $("cfg_scale").value.trim();
  if (cfg !== "") body.cfg_scale = Number(cfg);
  if ($("abc").value.trim()) body.abc = $("abc").value;
  for (const input of document.querySelectorAll("[data-phase]")) {
    if (input.value.trim() === "") continue;
    const key = `${input.dataset.phase}_sampling`;
    body[key] = body[key] || {};
    body[key][input.dataset.key] = Number(input.value);
  }
  if ($("instrumental").checked) {  // lyrics are optional for an instrumental: blank ones are left out
    body.instrumental = true;
    if (!body.lyrics.trim()) delete body.lyrics;
  }
  const adapters = chosenAdapters();
  if (adapters.length) body.adapters = adapters;
  if ($("plan-only").checked) body.stage = "plan";
  Object.assign(body, takesOf($("takes").value), overrides);
  let text = JSON.stringify(body);
  const seed = $("seed").value.trim();
  if (seed !== "") {  // seeds go up to 2**63: sent as typed, not through a float
    const literal = /^\d{1,19}$/.test(seed) ? seed : JSON.stringify(seed);
    text = text.slice(0, -1) + `,"seed":${literal}}`;
  }
  return text;
}

function clearInvalid() {
  for (const element of document.querySelectorAll("[aria-invalid]")) element.removeAttribute("aria-invalid");
}

// The field an error is about; a phase's min_tokens over its max_tokens is the max-tokens field's doing.
function controlFor(error) {
  const phase = /^(abc|semantic)_sampling$/.exec(error.field || "");
  if (phase && /min_tokens|max_tokens/.test(error.message)) return $(`${phase[1]}-max_tokens`);
  return error.field && $(FIELDS[error.field] || "");
}

function explain(error) {
  const phase = /^(abc|semantic)_sampling$/.exec(error.field || "");
  if (phase && /min_tokens must be in \[0, max_tokens\]/.test(error.message)) {
    return ` Max tokens is under this phase's min tokens (the server's default for the ${phase[1] === "abc"
      ? "score" : "song"}): raise it, or leave it empty.`;
  }
  return "";
}

export async function submit(event) {
  event.preventDefault();
  clearInvalid();
  show($("form-error"), "");
  saveKey();
  if (needKey()) {
    show($("form-error"), "This server needs its API key: enter it under Advanced.");
    $("api-key").setAttribute("aria-invalid", "true");
    $("api-key").focus();
    return;
  }
  const body = collect();
  const key = pendingKey && pendingKey.body === body ? pendingKey.key : crypto.randomUUID();
  pendingKey = { body, key };
  const button = $("submit");
  button.disabled = true;
  button.textContent = "Sending…";
  try {
    const job = await api("/v1/songs", { method: "POST", body,
      headers: { "Content-Type": "application/json", "Idempotency-Key": key } });
    pendingKey = null;
    await select(job.id);
    refreshJobs();
  } catch (error) {
    if (error.status !== undefined) pendingKey = null;  // answered: a new attempt is a new job
    show($("form-error"), describeError(error) + explain(error));
    const control = controlFor(error);
    if (control) {
      control.setAttribute("aria-invalid", "true");
      if (control.closest("details")) control.closest("details").open = true;
      control.focus();
    }
  } finally {
    button.disabled = false;
    button.textContent = "Make song";
  }
}
