// yue2-vllm's page: submit a song, follow it live (SSE over fetch, so an API key can be sent), play it.
"use strict";

const $ = (id) => document.getElementById(id);
const FINAL = new Set(["complete", "failed", "cancelled"]);
const STAGES = [  // stage, label, progress key, unit
  ["plan", "Score", "abc", "tokens"],
  ["semantic", "Song tokens", "semantic", "tokens"],
  ["synthesis", "Synthesis", "nar", "steps"],
  ["audio", "Decode", "vae", "tiles"],
];
const FIELDS = {  // an error's field -> the control to mark
  style: "style", tags: "style", lyrics: "lyrics", cot: "cot", seed: "seed", cfg_scale: "cfg_scale", abc: "abc",
  abc_sampling: "abc-temperature", semantic_sampling: "semantic-temperature", stage: "plan-only",
  instrumental: "instrumental",
  takes: "takes", best_of: "takes",
};

let apiKey = sessionStorage.getItem("yue2-api-key") || "";
let current = null;  // {id, doc, score, stream: AbortController, resultUrl, picture, audioAsked}
let pendingKey = null;  // {body, key}: reused only when the last attempt got no answer at all
let listed = "";  // the list as last drawn (redrawn only when it changed, so keyboard focus stays put)
let keyRequired = false;  // /health says whether /v1 needs a key: none is asked for (no 401) before one is typed

// ------------------------------------------------------------------ HTTP

function headers(extra) {
  const result = Object.assign({}, extra || {});
  if (apiKey) result.Authorization = "Bearer " + apiKey;
  return result;
}

async function api(path, options = {}) {
  const response = await fetch(path, Object.assign({}, options, { headers: headers(options.headers) }));
  const type = response.headers.get("content-type") || "";
  const body = type.includes("application/json") ? await response.json() : await response.text();
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

function describeError(error) {
  if (error.status === undefined) return `The server did not answer (${error.message}).`;
  let text = `${error.status}: ${error.message}`;
  if (error.status === 429 && error.retryAfter) text += ` Try again in ${error.retryAfter} s.`;
  if (error.status === 401) text += " Enter the API key under Advanced.";
  return text;
}

function askForKey() {
  $("advanced").open = true;
  show($("jobs-error"), apiKey ? "The API key was refused: enter the server's key under Advanced."
                               : "This server needs its API key: enter it under Advanced.");
}

function needKey() {  // true (and the key asked for) when /v1 would answer 401
  if (keyRequired && !apiKey) { askForKey(); return true; }
  return false;
}

async function blobOf(url) {  // a file fetched with the key, for a link or <audio> that cannot send it
  const response = await fetch(url, { headers: headers() });
  if (!response.ok) throw new Error(`${url.split("/").pop()}: ${response.status}`);
  return URL.createObjectURL(await response.blob());
}

function show(element, text) {
  element.textContent = text || "";
  element.hidden = !text;
}

// ------------------------------------------------------------------ the form

function randomSeed() {
  const words = crypto.getRandomValues(new Uint32Array(2));
  return ((BigInt(words[0] & 0x7fffffff) << 32n) | BigInt(words[1])).toString();
}

function collect() {
  const body = { style: $("style").value, lyrics: $("lyrics").value, cot: $("cot").value };
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
  if ($("plan-only").checked) body.stage = "plan";
  Object.assign(body, takesOf($("takes").value));
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

function saveKey() {
  apiKey = $("api-key").value.trim();
  sessionStorage.setItem("yue2-api-key", apiKey);
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

async function submit(event) {
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

// ------------------------------------------------------------------ one song

function stageText(stage, entry, progress) {
  const state = entry ? entry.state : "pending";
  const parts = [];
  if (progress && progress.max_tokens !== undefined) parts.push(`${progress.tokens}/${progress.max_tokens} tokens`);
  else if (progress && progress.total) parts.push(`${progress.done}/${progress.total}`);
  if (entry && entry.backend_actual) parts.push(entry.backend_actual);
  if (entry && entry.fallback_reason) parts.push(`fallback: ${entry.fallback_reason}`);
  if (entry && typeof entry.seconds === "number") parts.push(`${entry.seconds.toFixed(1)} s`);
  if (state === "reused") parts.push("reused");
  if (state === "pending") parts.push("waiting");
  return parts.join(" · ");
}

function renderBars(doc) {
  const bars = $("bars");
  bars.textContent = "";
  for (const [stage, label, key] of STAGES) {
    if (!(stage in doc.stages)) continue;
    const entry = doc.stages[stage];
    const progress = doc.progress[key];
    const finished = entry.state === "done" || entry.state === "reused";
    let value = 0, max = 1;
    if (finished) value = 1;
    else if (progress && progress.max_tokens) { value = progress.tokens; max = progress.max_tokens; }
    else if (progress && progress.total) { value = progress.done; max = progress.total; }
    const wrapper = document.createElement("div");
    const id = `bar-${stage}`;
    wrapper.innerHTML = `<div class="bar-label"><label for="${id}"></label><span></span></div><progress id="${id}"></progress>`;
    wrapper.querySelector("label").textContent = label;
    wrapper.querySelector("span").textContent = stageText(stage, entry, progress);
    const bar = wrapper.querySelector("progress");
    bar.max = max;
    bar.value = Math.min(value, max);
    if (finished) bar.classList.add("done");
    bars.appendChild(wrapper);
  }
}

// ------------------------------------------------------------------ the song's picture

// The server's picture of a song (GET …/peaks, computed once from its FLAC): per channel (min, max) int8 pairs,
// and a log-frequency spectrogram as uint8 levels, column after column, lowest band first.
function bytesOf(base64) {
  const text = atob(base64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

function pictureFrom(answer) {
  const lanes = answer.peaks.slice(0, 2).map((lane) => {
    const pairs = new Int8Array(bytesOf(lane).buffer);
    return Float32Array.from(pairs, (v) => v / 127);
  });
  const levels = bytesOf(answer.spectrogram);
  const { columns, rows } = answer;
  const image = new ImageData(columns, rows);
  for (let x = 0; x < columns; x++) {
    for (let r = 0; r < rows; r++) {
      const [red, green, blue] = heat(levels[x * rows + r] / 255);
      const at = ((rows - 1 - r) * columns + x) * 4;
      image.data[at] = red; image.data[at + 1] = green; image.data[at + 2] = blue; image.data[at + 3] = 255;
    }
  }
  return { lanes, buckets: answer.buckets, spectrogram: image, duration: answer.duration };
}

// A song's picture (pictureFrom), or null when `stillShown()` says the view moved on to another song meanwhile,
// so a late answer never lands under it.
async function fetchPicture(doc, stillShown) {
  const answer = await api(`${doc.urls.self}/peaks`);
  return stillShown() ? pictureFrom(answer) : null;
}

function heat(v) {  // dark blue → purple → orange → pale yellow
  const stops = [[12, 10, 40], [90, 30, 130], [200, 60, 90], [250, 160, 50], [252, 250, 190]];
  const at = v * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(at)), t = at - i;
  return stops[i].map((c, k) => Math.round(c + (stops[i + 1][k] - c) * t));
}

function drawPicture() {
  const picture = current && current.picture;
  if (!picture) return;
  drawPictureInto(picture, $("waveform"), $("spectrogram"));
  movePlayhead();
}

// A picture (pictureFrom) into two canvases: both channels' peaks per pixel, and the spectrogram.
function drawPictureInto(picture, wave, spectrum) {
  const ratio = window.devicePixelRatio || 1;
  const width = Math.max(1, Math.round(wave.clientWidth * ratio)), height = Math.round(wave.clientHeight * ratio);
  wave.width = width;
  wave.height = height;
  const context = wave.getContext("2d");
  const style = getComputedStyle(document.documentElement);
  context.clearRect(0, 0, width, height);
  const lane = height / 2;
  picture.lanes.forEach((peaks, c) => {
    const middle = lane * c + lane / 2, scale = lane / 2 - 2 * ratio;
    context.fillStyle = style.getPropertyValue("--line");
    context.fillRect(0, Math.round(middle), width, Math.max(1, Math.round(ratio / 2)));
    context.fillStyle = style.getPropertyValue("--accent");
    for (let x = 0; x < width; x++) {  // this pixel's extremes: over every bucket it covers
      const first = Math.floor(x * picture.buckets / width);
      const last = Math.max(first + 1, Math.floor((x + 1) * picture.buckets / width));
      let low = 0, high = 0;
      for (let b = first; b < last; b++) {
        if (peaks[2 * b] < low) low = peaks[2 * b];
        if (peaks[2 * b + 1] > high) high = peaks[2 * b + 1];
      }
      const top = middle - high * scale, bottom = middle - low * scale;
      context.fillRect(x, top, 1, Math.max(1, bottom - top));
    }
  });
  if (picture.spectrogram) {
    spectrum.hidden = false;
    spectrum.width = picture.spectrogram.width;
    spectrum.height = picture.spectrogram.height;
    spectrum.getContext("2d").putImageData(picture.spectrogram, 0, 0);
  } else if (spectrum) spectrum.hidden = true;
}

function movePlayhead() {
  const audio = $("audio");
  const duration = audio.duration || (current && current.picture && current.picture.duration) || 0;
  $("played").style.width = duration ? `${Math.min(100, 100 * audio.currentTime / duration)}%` : "0";
}

function seekTo(fraction) {
  const audio = $("audio");
  const duration = audio.duration || (current && current.picture && current.picture.duration) || 0;
  if (!duration) return;
  audio.currentTime = Math.max(0, Math.min(1, fraction)) * duration;
  movePlayhead();
}

// ------------------------------------------------------------------ the streaming player

// A URL the <audio> element plays directly (Range requests: it starts before the download ends). With an API key
// it is a short-lived signed URL (GET …/audio-url), since the element cannot send the key.
async function playableUrl(doc) {
  return (await api(`${doc.urls.self}/audio-url`)).url;
}

// Play `doc`'s audio in `audio` while `stillShown()`; a signed URL that expired mid-song is renewed where it was.
async function streamInto(audio, doc, stillShown) {
  const url = await playableUrl(doc);
  if (!stillShown()) return null;
  let renewed = 0;
  audio.onerror = async () => {
    if (!stillShown() || !audio.error || Date.now() - renewed < 5000) return;
    renewed = Date.now();
    const at = audio.currentTime, playing = !audio.paused;
    try {
      const fresh = await playableUrl(doc);
      if (!stillShown()) return;
      audio.src = fresh;
      audio.currentTime = at;
      if (playing) audio.play().catch(() => {});
    } catch (error) { console.warn(`the song's audio: ${error.message}`); }
  };
  audio.dataset.song = doc.id;
  audio.src = url;
  return url;
}

async function showAudio(doc) {
  const shown = current;
  const stillShown = () => current === shown;
  const audioUrl = await streamInto($("audio"), doc, stillShown);
  if (audioUrl === null) return;
  let result = doc.urls.result;
  $("download").href = audioUrl;  // the signed URL (or the plain one) downloads too: no blob of the whole song
  $("download").download = `${doc.label || doc.id}.flac`;
  $("player").hidden = false;
  if (apiKey) {  // a link cannot send the key: a blob of the (small) result
    result = await blobOf(doc.urls.result);
    if (!stillShown()) { URL.revokeObjectURL(result); return; }
    current.resultUrl = result;
  }
  $("result-link").href = result;
  $("result-link").download = apiKey ? `${doc.label || doc.id}.result.json` : "";
  if (!apiKey) $("result-link").removeAttribute("download");
  fetchPicture(doc, stillShown).then((picture) => {
    if (picture === null || !stillShown()) return;
    current.picture = picture;
    $("picture").dataset.song = doc.id;
    $("picture").hidden = false;
    drawPicture();
  }).catch((error) => {  // the song still plays without its picture
    if (stillShown()) $("picture").hidden = true;
    console.warn(`the song's picture: ${error.message}`);
  });
}

function render() {
  const doc = current.doc;
  $("current").hidden = false;
  $("current-title").textContent = doc.label || doc.request.style.slice(0, 60) || doc.id;
  const status = $("current-status");
  status.textContent = doc.status;
  status.className = "badge " + (FINAL.has(doc.status) ? doc.status : doc.status === "queued" ? "" : "running");
  const parts = [doc.id, `cot ${doc.request.cot}`, `seed ${doc.request.seed}`];
  if (doc.queue_position !== undefined && doc.status === "queued") parts.push(`${doc.queue_position} ahead in the queue`);
  if (doc.result && doc.result.audio_seconds) parts.push(`${doc.result.audio_seconds.toFixed(1)} s of audio`);
  if (doc.retries && doc.retries.length) parts.push(`retried: ${doc.retries[doc.retries.length - 1].reason}`);
  $("current-meta").textContent = parts.join(" · ");
  renderBars(doc);
  show($("current-error"), doc.error ? `${doc.error.type}: ${doc.error.message}` : "");
  $("cancel").hidden = FINAL.has(doc.status);
  $("render").hidden = !(doc.stage === "plan" && doc.status === "complete");
  $("resume").hidden = !(doc.status === "failed" || doc.status === "cancelled");
  const plan = doc.stages.plan || {};
  const planned = plan.state === "done" || plan.state === "reused";
  if (planned && current.score === null && doc.request.cot !== "off") {
    current.score = "";
    api(doc.urls.score).then((text) => { current.score = text; $("score").textContent = text; }).catch(() => {});
  }
  $("score-box").hidden = !current.score;
  $("score").textContent = current.score || "";
  if (doc.status === "complete" && doc.stage === "audio" && $("player").hidden && !current.audioAsked) {
    current.audioAsked = true;
    const shown = current;
    showAudio(doc).catch((error) => { if (current === shown) show($("current-error"), describeError(error)); });
  }
  renderTakes(doc);
}

// ------------------------------------------------------------------ takes, side by side

function takesOf(value) {  // the form's take count: takes > 1 are sent with best_of (the pick is marked)
  const takes = Number(String(value).trim() || 1);
  return takes === 1 ? {} : { takes, best_of: true };
}

function takeSignal(entry) {
  const value = entry.signals && entry.signals.semantic_mean_logprob;
  return typeof value === "number" ? `log-prob ${value.toFixed(3)}` : "";
}

// A take's player and waveform: the take is a job of its own, so it streams from its own signed URL and is drawn
// from its own peaks answer, like the song shown above (streamInto, fetchPicture); nothing lands once the view
// shows another song.
async function loadTake(card, entry, id) {
  const shown = current;
  const stillShown = () => current === shown && current.id === id && card.isConnected;
  const take = { id: entry.id, urls: { self: `/v1/songs/${entry.id}` } };
  const audio = card.querySelector("audio");
  if (await streamInto(audio, take, stillShown) === null) return;
  const picture = await fetchPicture(take, stillShown);
  if (picture) drawPictureInto({ ...picture, spectrogram: null }, card.querySelector("canvas"), null);
}

function takeCard(doc, entry) {
  const takes = doc.takes;
  const card = document.createElement("div");
  card.className = "take" + (takes.kept === entry.take ? " kept" : "");
  card.dataset.take = entry.take;
  card.innerHTML = `<strong></strong> <span class="badge"></span><p class="meta"></p>
    <canvas aria-hidden="true"></canvas><audio controls preload="metadata"></audio>
    <div class="actions"><button type="button" class="small" data-keep>Keep</button>
    <button type="button" class="secondary small" data-delete>Delete</button></div>`;
  card.querySelector("strong").textContent = `Take ${entry.take}` + (takes.pick === entry.take ? " ★" : "");
  const badge = card.querySelector(".badge");
  badge.textContent = takes.kept === entry.take ? "kept" : entry.status;
  badge.classList.add(FINAL.has(entry.status) ? entry.status : "running");
  card.querySelector(".meta").textContent = [`seed ${entry.seed}`, takeSignal(entry), entry.error || ""]
    .filter(Boolean).join(" · ");
  const keep = card.querySelector("[data-keep]"), remove = card.querySelector("[data-delete]");
  keep.setAttribute("aria-label", `Keep take ${entry.take}`);
  remove.setAttribute("aria-label", `Delete take ${entry.take}`);
  keep.hidden = entry.status !== "complete" || takes.kept === entry.take;
  remove.hidden = entry.take === 1;  // take 1 is the job: Delete above removes it with every take
  keep.addEventListener("click", () => takeAction(doc.id, entry.take, "keep"));
  remove.addEventListener("click", () => takeAction(doc.id, entry.take, "delete"));
  if (entry.status === "complete" && doc.stage === "audio") {
    loadTake(card, entry, doc.id).catch((error) => console.warn(error.message));
  }
  return card;
}

function renderTakes(doc) {
  const takes = doc.takes && doc.takes.entries ? doc.takes : null;
  $("takes-box").hidden = !takes;
  if (!takes) return;
  const entries = takes.entries.filter((entry) => entry.status !== "deleted");
  const drawn = JSON.stringify([entries.map((e) => [e.take, e.status]), takes.kept, takes.pick]);
  if (current.takesDrawn !== drawn) {  // redrawn only when a take changed (players keep playing otherwise)
    current.takesDrawn = drawn;
    const list = $("takes-list");
    list.textContent = "";
    for (const entry of entries) list.appendChild(takeCard(doc, entry));
  }
  clearTimeout(current.takesTimer);
  if (entries.some((entry) => !FINAL.has(entry.status))) {  // the job's stream is take 1's: poll for the others
    const id = doc.id;
    current.takesTimer = setTimeout(() => {
      api(`/v1/songs/${id}`).then((fresh) => {
        if (current && current.id === id) { current.doc = fresh; render(); }
      }).catch(() => {});
    }, 1000);
  }
}

async function takeAction(id, take, action) {  // keep (POST) or delete (DELETE) one take
  try {
    if (action === "delete") {
      if (!confirm(`Delete take ${take} of song ${id} and its files? This cannot be undone.`)) return;
      await api(`/v1/songs/${id}/takes/${take}`, { method: "DELETE" });
    } else {
      await api(`/v1/songs/${id}/takes/${take}/keep`, { method: "POST" });
    }
    if (current && current.id === id) { current.doc = await api(`/v1/songs/${id}`); render(); }
  } catch (error) {
    show($("current-error"), describeError(error));
  }
}

function onEvent(id, kind, data) {
  if (!current || current.id !== id) return true;
  const doc = current.doc;
  if (kind === "status") current.doc = data;
  else if (kind === "state") {
    doc.status = data.status;
    if (data.stage) doc.stages[data.stage] = Object.assign(doc.stages[data.stage] || {}, { state: "running" });
  } else if (kind === "tokens") doc.progress[data.phase] = { tokens: data.count, max_tokens: data.max_tokens };
  else if (kind === "nar" || kind === "vae") doc.progress[kind] = { done: data.done, total: data.total };
  else if (kind === "stage") {
    doc.stages[data.stage] = Object.assign(doc.stages[data.stage] || {}, data);
    const key = { plan: "abc", semantic: "semantic" }[data.stage];
    if (key && doc.progress[key] && typeof data.tokens === "number") doc.progress[key].tokens = data.tokens;
  } else if (kind === "score") { if (data.abc) current.score = data.abc; }
  else if (kind === "retry") doc.retries = (doc.retries || []).concat([{ reason: data.reason }]);
  else if (FINAL.has(kind)) {
    api(doc.urls.self).then((fresh) => { if (current && current.id === id) { current.doc = fresh; render(); } })
      .catch((error) => { if (error.status === 404 && current && current.id === id) forget(); });  // deleted
    refreshJobs();
    refreshHealth();
    return true;
  }
  render();
  return false;
}

async function follow(id, signal) {
  let delay = 500;
  while (!signal.aborted) {
    try {
      const response = await fetch(`/v1/songs/${id}/events`, { headers: headers({ Accept: "text/event-stream" }), signal });
      if (response.status === 404 || response.status === 401) return;
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "", pendingCR = false;
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        // A line ends at CRLF, LF or CR (the event-stream format); a CR at a chunk's end may start a CRLF.
        let text = (pendingCR ? "\r" : "") + decoder.decode(value, { stream: true });
        pendingCR = text.endsWith("\r");
        if (pendingCR) text = text.slice(0, -1);
        buffer += text.replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          let kind = "message", data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event: ")) kind = line.slice(7);
            else if (line.startsWith("data: ")) data += (data ? "\n" : "") + line.slice(6);
          }
          if (data && onEvent(id, kind, JSON.parse(data))) return;
        }
        delay = 500;
      }
    } catch (error) {
      if (signal.aborted) return;
    }
    await new Promise((resolve) => setTimeout(resolve, delay));  // the server restarted? it resumes the job
    delay = Math.min(delay * 2, 8000);
  }
}

function clearPlayer() {  // nothing of the song shown before stays in the view
  const audio = $("audio");
  audio.onerror = null;
  audio.removeAttribute("src");
  delete audio.dataset.song;
  audio.load();
  $("player").hidden = true;
  $("picture").hidden = true;
  delete $("picture").dataset.song;
}

function forget() {  // the shown song was deleted
  if (current.stream) current.stream.abort();
  if (current.resultUrl) URL.revokeObjectURL(current.resultUrl);
  clearPlayer();
  current = null;
  $("current").hidden = true;
  history.replaceState(null, "", location.pathname);
}

let selecting = 0;  // the latest select(): an earlier one still waiting for its song gives way

async function select(id) {
  if (current && current.stream) current.stream.abort();
  if (current && current.resultUrl) URL.revokeObjectURL(current.resultUrl);
  current = null;  // from here on, nothing an earlier song's requests bring back is shown
  clearPlayer();
  const mine = ++selecting;
  const doc = await api(`/v1/songs/${id}`);
  if (mine !== selecting) return;
  current = { id, doc, score: null, stream: new AbortController(), resultUrl: null, picture: null, audioAsked: false };
  history.replaceState(null, "", `#${id}`);
  render();
  for (const row of document.querySelectorAll("#jobs tr")) row.classList.toggle("selected", row.dataset.id === id);
  if (!FINAL.has(doc.status)) follow(id, current.stream.signal);
}

async function act(id, action) {  // cancel, resume, render (POST) or delete (DELETE)
  try {
    if (action === "delete") {
      if (!confirm(`Delete song ${id} and its files? This cannot be undone.`)) return;
      await api(`/v1/songs/${id}`, { method: "DELETE" });
      if (current && current.id === id) forget();
    } else {
      await api(`/v1/songs/${id}/${action}`, { method: "POST" });
      if (current && current.id === id) await select(id);
    }
    refreshJobs();
  } catch (error) {
    show(current && current.id === id ? $("current-error") : $("jobs-error"), describeError(error));
  }
}

// ------------------------------------------------------------------ the list and health

async function refreshJobs() {
  if (needKey()) return;
  try {
    const page = await api("/v1/songs?limit=20");
    show($("jobs-error"), "");
    const drawn = JSON.stringify(page.songs);
    if (drawn === listed) return;
    listed = drawn;
    const rows = $("jobs");
    const focused = document.activeElement && rows.contains(document.activeElement)
      ? document.activeElement.getAttribute("aria-label") : null;
    rows.textContent = "";
    for (const song of page.songs) {
      const row = document.createElement("tr");
      row.dataset.id = song.id;
      if (current && current.id === song.id) row.classList.add("selected");
      const created = new Date(song.created);
      row.innerHTML = `<td></td><td class="style"></td><td><span class="badge"></span></td><td></td>
        <td class="actions-cell"><button type="button" class="secondary small" data-open>Open</button></td>`;
      const cells = row.querySelectorAll("td");
      cells[0].textContent = created.toLocaleTimeString();
      cells[0].title = created.toLocaleString();
      cells[1].textContent = song.label ? `${song.label}: ${song.style}` : song.style;
      cells[1].title = song.error || song.style;
      const badge = cells[2].querySelector(".badge");
      badge.textContent = song.status;
      badge.classList.add(FINAL.has(song.status) ? song.status : song.status === "queued" ? "queued" : "running");
      cells[3].textContent = song.audio_seconds ? `${song.audio_seconds.toFixed(1)} s` : "";
      row.querySelector("[data-open]").setAttribute("aria-label", `Open song ${song.id}`);
      row.querySelector("[data-open]").addEventListener("click", () => select(song.id));
      if (!FINAL.has(song.status)) {
        const cancel = document.createElement("button");
        cancel.type = "button";
        cancel.className = "secondary small";
        cancel.textContent = "Cancel";
        cancel.setAttribute("aria-label", `Cancel song ${song.id}`);
        cancel.addEventListener("click", () => act(song.id, "cancel"));
        cells[4].appendChild(cancel);
      }
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "secondary small";
      remove.textContent = "Delete";
      remove.setAttribute("aria-label", `Delete song ${song.id}`);
      remove.addEventListener("click", () => act(song.id, "delete"));
      cells[4].appendChild(remove);
      rows.appendChild(row);
    }
    $("jobs-empty").hidden = page.songs.length > 0;
    const again = focused && [...rows.querySelectorAll("button")].find((b) => b.getAttribute("aria-label") === focused);
    if (again) again.focus();
  } catch (error) {
    show($("jobs-error"), describeError(error));
  }
}

async function refreshHealth() {
  const element = $("health");
  try {
    const response = await fetch("/health");
    const health = await response.json();
    keyRequired = Boolean(health.api_key_required);
    const engine = health.engine;
    const what = engine.backend === "vllm" ? `vLLM engine ${engine.state}` : "torch backend";
    const replicas = health.replicas ? ` · replicas ${health.replicas}` : "";
    element.textContent = `${what}${replicas} · ${health.in_flight} in flight · queue ${health.queue.depth}/${health.queue.limit}`;
    element.className = "health " + (response.ok ? "ok" : "down");
  } catch (error) {
    element.textContent = "the server does not answer";
    element.className = "health down";
  }
}

// ------------------------------------------------------------------ start

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = apiKey;
  $("song-form").addEventListener("submit", submit);
  $("song-form").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("song-form").requestSubmit();
  });
  $("song-form").addEventListener("input", (event) => event.target.removeAttribute("aria-invalid"));
  $("random-seed").addEventListener("click", () => { $("seed").value = randomSeed(); });
  $("instrumental").addEventListener("change", () => { $("lyrics").required = !$("instrumental").checked; });
  $("cancel").addEventListener("click", () => current && act(current.id, "cancel"));
  $("render").addEventListener("click", () => current && act(current.id, "render"));
  $("resume").addEventListener("click", () => current && act(current.id, "resume"));
  $("delete").addEventListener("click", () => current && act(current.id, "delete"));
  $("refresh").addEventListener("click", refreshJobs);
  $("picture").addEventListener("click", (event) => {
    const box = $("picture").getBoundingClientRect();
    seekTo((event.clientX - box.left) / box.width);
  });
  $("picture").addEventListener("keydown", (event) => {
    const audio = $("audio"), duration = audio.duration || 0;
    const step = { ArrowLeft: -5, ArrowRight: 5, Home: -Infinity, End: Infinity }[event.key];
    if (step === undefined || !duration) return;
    event.preventDefault();
    seekTo((Math.max(0, Math.min(duration, audio.currentTime + step))) / duration);
  });
  for (const kind of ["timeupdate", "seeked", "loadedmetadata"]) $("audio").addEventListener(kind, movePlayhead);
  $("audio").addEventListener("play", function tick() {  // smoother than timeupdate while it plays
    movePlayhead();
    if (!$("audio").paused) requestAnimationFrame(tick);
  });
  let resized = null;
  window.addEventListener("resize", () => { clearTimeout(resized); resized = setTimeout(drawPicture, 100); });
  $("api-key").addEventListener("change", () => { saveKey(); show($("jobs-error"), ""); listed = ""; refreshJobs(); });
  setInterval(() => { if (!document.hidden) { refreshHealth(); refreshJobs(); } }, 4000);
  refreshHealth().then(() => {  // whether a key is needed is known before anything under /v1 is asked
    refreshJobs();
    const id = location.hash.slice(1);
    if (/^j[0-9a-f]{20}$/.test(id) && !needKey()) {
      select(id).catch(() => history.replaceState(null, "", location.pathname));
    }
  });
});
