// The score panel: a score as music. Its notation (both voices, chord symbols) drawn by abcjs, played by a plain
// synth from the server's reader's notes, its ABC editable with the reader's verdict as you type (one line naming
// the score line), rendered as a new song from the edit, and downloaded as ABC or MIDI.
// `showScore(text, source)` opens any score: a song's (`songSource`), or a melody's transcription (melody.js: a source
// without files, whose `body` renders it as a cover with the form's fields).

import { $, api, describeError, headers, show } from "./api.js";
import { drawNotation } from "./notation.js";
import { play, playing, stop } from "./synth.js";

const CHECK_DELAY_MS = 250;

// source: {key, label, abcUrl, midiUrl (null: made from the text), describe(cot), body(abc, cot) -> Promise<JSON
// text>}; text: the editor's;
// verdict: the reader's answer for `checked`; drawn: {text, music} of the notation shown (the last valid text)
export const panel = { source: null, original: "", text: "", checked: null, verdict: null, drawn: null, asked: 0,
                       timer: null };
const hooks = { opened: () => {} };  // opened(jobId): show a song the panel made

export function wireScore({ opened }) {
  hooks.opened = opened;
  $("score-text").addEventListener("input", () => edited($("score-text").value));
  $("score-play").addEventListener("click", toggle);
  $("score-revert").addEventListener("click", () => {
    $("score-text").value = panel.original;
    edited(panel.original);
  });
  $("score-render").addEventListener("click", () => renderEdit().catch(() => {}));
  $("score-check").addEventListener("click", showProblemLine);
  // a song's files from the server; a source without files (a melody's transcription) from its text
  $("score-abc").addEventListener("click", () => download(() => panel.source.abcUrl ? fetchBlob(panel.source.abcUrl)
    : textBlob(panel.original), "abc"));
  $("score-midi").addEventListener("click", () => download(() => panel.source.midiUrl
    ? fetchBlob(panel.source.midiUrl) : midiOf(panel.original), "mid"));
  $("edit-abc").addEventListener("click", () => download(() => textBlob(panel.text), "edit.abc"));
  $("edit-midi").addEventListener("click", () => download(() => midiOf(panel.text), "edit.mid"));
}

async function textBlob(text) {
  return new Blob([text], { type: "text/vnd.abc" });
}

function midiOf(text) {  // the server's MIDI of a score
  return fetchBlob("/v1/scores/midi", { method: "POST", body: JSON.stringify({ abc: text }),
                                        headers: { "Content-Type": "application/json" } });
}

// A song's score as a source: downloads from its files, a render keeps its request (seed, style, lyrics, ...).
export function songSource(doc) {
  return {
    key: `song:${doc.id}`, label: doc.label || doc.id, abcUrl: doc.urls.score, midiUrl: `${doc.urls.score}.mid`,
    describe: (cot) => `a new song with this song's seed ${doc.request.seed}, style and lyrics, cot ${cot}`,
    body: async (abc, cot) => renderBody(doc, abc, cot),
  };
}

// The POST /v1/songs body that renders `abc` with the song's request: the same seed, style, lyrics, guidance,
// length, adapters and song sampling (the score phase is skipped: the score is given), the cot the score takes, and a
// cover's transcription record (its licence with it; the server works out whether `abc` is the score as transcribed).
export function renderBody(doc, abc, cot) {
  const request = doc.request;
  const body = { style: request.style, lyrics: request.lyrics, cot, abc };
  if (request.transcription) body.transcription = request.transcription;  // its `edited` is worked out again
  if (request.instrumental) {
    body.instrumental = true;
    if (!String(request.lyrics || "").trim()) delete body.lyrics;
  }
  for (const name of ["cfg_scale", "seconds"]) {
    if (request[name] !== undefined && request[name] !== null) body[name] = request[name];
  }
  if (request.adapters && request.adapters.length) body.adapters = request.adapters;
  if (doc.sampling && doc.sampling.semantic) body.semantic_sampling = doc.sampling.semantic;
  const seed = String(request.seed);
  return JSON.stringify(body).slice(0, -1) + `,"seed":${/^\d{1,19}$/.test(seed) ? seed : JSON.stringify(seed)}}`;
}

// Open `text` from `source`; the same score of the same source again keeps the edit.
export function showScore(text, source) {
  if (panel.source && panel.source.key === source.key && panel.original === text) return;
  stop();
  clearTimeout(panel.timer);  // an edit's check still waiting is for the score shown before
  Object.assign(panel, { source, original: text, text, checked: null, verdict: null, drawn: null });
  $("score-card").hidden = false;
  $("score-text").value = text;
  $("notation").textContent = "";
  show($("score-error"), "");
  $("score-midi").hidden = true;
  refresh();
  check(text);
}

// Whether the panel holds a melody's transcription (melody.js): the song in view leaves it be; opening a song (or
// the shown one deleted) replaces it.
export function showsMelody() {
  return Boolean(panel.source && panel.source.key.startsWith("melody:"));
}

export function hideScore() {
  stop();
  clearTimeout(panel.timer);
  panel.source = null;
  panel.asked += 1;  // an answer on its way is for a score no longer shown
  $("score-card").hidden = true;
}

function edited(text) {
  panel.text = text;
  show($("score-error"), "");
  clearTimeout(panel.timer);
  panel.timer = setTimeout(() => check(text), CHECK_DELAY_MS);
  refresh();
}

async function check(text) {
  const asked = ++panel.asked;
  const source = panel.source;
  let verdict;
  try {
    verdict = await api("/v1/scores/check", { method: "POST", body: JSON.stringify({ abc: text }),
                                              headers: { "Content-Type": "application/json" } });
  } catch (error) {
    if (asked === panel.asked) show($("score-error"), `The check failed: ${describeError(error)}`);
    return;
  }
  if (asked !== panel.asked || panel.source !== source) return;  // a later text, or another score, is shown
  panel.checked = text;
  panel.verdict = verdict;
  if (text === panel.original) $("score-midi").hidden = !verdict.valid;  // the song's own score.mid
  if (verdict.valid && (!panel.drawn || panel.drawn.text !== text)) {
    try {
      const wanted = () => asked === panel.asked && panel.source === source;
      if (!await drawNotation($("notation"), text, $("score-card").clientWidth, wanted)) return;
      if (playing()) stop();
      panel.drawn = { text, music: verdict.score };
    } catch (error) {
      show($("score-error"), `The notation could not be drawn: ${error.message}`);
    }
  }
  refresh();
}

function minutes(seconds) {
  const whole = Math.floor(seconds);
  return `${Math.floor(whole / 60)}:${String(whole % 60).padStart(2, "0")}`;
}

function facts(music) {
  const harmony = music.chords.length ? `${music.chords.length} chord symbols` : "no chord symbols";
  return `${music.meter} · K:${music.key} · ♩ = ${music.bpm} · ${music.bars} bars · ${minutes(music.seconds)} · ` +
    `${music.voices.Vocal.length} Vocal and ${music.voices.Ins.length} Ins notes · ${harmony}`;
}

function verdictText(verdict) {
  if (!verdict.valid) return verdict.problem;
  return `Reads as YuE2's score: it renders with cot ${verdict.score.cot} (` +
    (verdict.score.cot === "full" ? "it has chord symbols" : "no chord symbols") + ").";
}

// The panel drawn from its state: the verdict line (the last one, faded, while the text's own is on its way), the
// notation (faded while the text does not read) or the raw text when nothing valid was drawn, and which controls
// work.
function refresh() {
  const current = panel.checked === panel.text ? panel.verdict : null;
  const shown = current || panel.verdict;
  const line = $("score-check");
  line.classList.toggle("bad", Boolean(shown && !shown.valid));
  line.classList.toggle("ok", Boolean(shown && shown.valid));
  line.classList.toggle("pending", current === null);
  line.textContent = shown ? verdictText(shown) : "Checking…";
  line.title = current && !current.valid && current.line ? "Click to select the line in the editor" : "";
  if (current && !current.valid) $("score-text").setAttribute("aria-invalid", "true");
  else $("score-text").removeAttribute("aria-invalid");
  const drawn = panel.drawn;
  $("notation").hidden = drawn === null;
  $("notation").classList.toggle("stale", drawn !== null && drawn.text !== panel.text);
  $("score").hidden = drawn !== null;
  $("score").textContent = panel.text;
  $("score-facts").textContent = drawn ? facts(drawn.music) : "";
  $("score-play").disabled = drawn === null;
  $("score-play").textContent = playing() ? "■ Stop" : "▶ Play";
  const ready = Boolean(current && current.valid && panel.source);
  $("score-render").disabled = !ready;
  $("edit-midi").disabled = !ready;
  $("score-render-hint").textContent = ready ? `Makes ${panel.source.describe(current.score.cot)}.` : "";
  $("score-revert").disabled = panel.text === panel.original;
}

function toggle() {
  if (playing()) { stop(); return; }
  const drawn = panel.drawn;
  if (!drawn) return;
  const total = minutes(drawn.music.seconds);
  play(drawn.music, {
    onTime: (seconds) => { $("score-time").textContent = `${minutes(seconds)} / ${total}`; },
    onEnd: () => { $("score-time").textContent = ""; refresh(); },
  });
  refresh();
}

function showProblemLine() {  // the line the verdict names, selected in the editor
  const verdict = panel.checked === panel.text ? panel.verdict : null;
  if (!verdict || verdict.valid || !verdict.line) return;
  const lines = panel.text.split(/\r\n|\n|\r/);
  const start = lines.slice(0, verdict.line - 1).reduce((sum, line) => sum + line.length + 1, 0);
  $("score-editor").open = true;
  const area = $("score-text");
  area.focus();
  area.setSelectionRange(start, start + (lines[verdict.line - 1] || "").length);
}

async function fetchBlob(url, options = {}) {
  const response = await fetch(url, Object.assign({}, options, { headers: headers(options.headers) }));
  if (!response.ok) {
    let message = `${response.status}`;
    try { message = `${response.status}: ${(await response.json()).error.message}`; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return response.blob();
}

// Save what `make()` gives as LABEL.SUFFIX (a blob: with an API key a link could not send the key).
async function download(make, suffix) {
  show($("score-error"), "");
  try {
    const url = URL.createObjectURL(await make());
    const link = document.createElement("a");
    link.href = url;
    link.download = `${panel.source.label}.${suffix}`;
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
  } catch (error) {
    show($("score-error"), `The download failed: ${error.message}`);
  }
}

async function renderEdit() {
  const text = panel.text;
  const verdict = panel.checked === text ? panel.verdict : null;
  if (!verdict || !verdict.valid) return;
  const button = $("score-render");
  button.disabled = true;
  button.textContent = "Sending…";
  show($("score-error"), "");
  try {
    const body = await panel.source.body(text, verdict.score.cot);
    const job = await api("/v1/songs", { method: "POST", body, headers: {
      "Content-Type": "application/json", "Idempotency-Key": crypto.randomUUID() } });
    await hooks.opened(job.id);
  } catch (error) {
    show($("score-error"), describeError(error));
  } finally {
    button.textContent = "Render as a new song";
    refresh();
  }
}
