// The song in view: its stage bars, score (in the score panel), player and picture, and takes, kept live from its
// event stream.
// Whatever changes the list of songs dispatches "songs-changed" on document (detail.health: /health too).

import { $, FINAL, api, auth, blobOf, describeError, show } from "./api.js";
import { drawPictureInto, fetchPicture } from "./picture.js";
import { clearPlayer, movePlayhead, streamInto } from "./player.js";
import { follow } from "./stream.js";
import { minutes, renderContinue } from "./length.js";
import { hideScore, showScore, showsMelody, songSource } from "./score.js";
import { renderTakes } from "./takes.js";
import { showTranscription } from "./transcribed.js";

const STAGES = [  // stage, label, progress key, unit
  ["plan", "Score", "abc", "tokens"],
  ["semantic", "Song tokens", "semantic", "tokens"],
  ["synthesis", "Synthesis", "nar", "steps"],
  ["audio", "Decode", "vae", "tiles"],
];

// current: {id, doc, score, stream: AbortController, resultUrl, picture, audioAsked, takesDrawn, takesTimer}
export const view = { current: null };

function songsChanged(health = false) {
  document.dispatchEvent(new CustomEvent("songs-changed", { detail: { health } }));
}

export function pictureSeconds() {  // the shown song's picture's duration, 0 when none is drawn
  const current = view.current;
  return (current && current.picture && current.picture.duration) || 0;
}

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

export function drawPicture() {
  const picture = view.current && view.current.picture;
  if (!picture) return;
  drawPictureInto(picture, $("waveform"), $("spectrogram"));
  movePlayhead(pictureSeconds);
}

async function showAudio(doc) {
  const shown = view.current;
  const stillShown = () => view.current === shown;
  const audioUrl = await streamInto($("audio"), doc, stillShown);
  if (audioUrl === null) return;
  let result = doc.urls.result;
  $("download").href = audioUrl;  // the signed URL (or the plain one) downloads too: no blob of the whole song
  $("download").download = `${doc.label || doc.id}.flac`;
  $("player").hidden = false;
  if (auth.key) {  // a link cannot send the key: a blob of the (small) result
    result = await blobOf(doc.urls.result);
    if (!stillShown()) { URL.revokeObjectURL(result); return; }
    shown.resultUrl = result;
  }
  $("result-link").href = result;
  $("result-link").download = auth.key ? `${doc.label || doc.id}.result.json` : "";
  if (!auth.key) $("result-link").removeAttribute("download");
  fetchPicture(doc, stillShown).then((picture) => {
    if (picture === null || !stillShown()) return;
    shown.picture = picture;
    $("picture").dataset.song = doc.id;
    $("picture").hidden = false;
    drawPicture();
  }).catch((error) => {  // the song still plays without its picture
    if (stillShown()) $("picture").hidden = true;
    console.warn(`the song's picture: ${error.message}`);
  });
}

// The shown song's document fetched again and drawn, unless the view moved on meanwhile.
async function reload(id) {
  const shows = () => view.current && view.current.id === id;
  if (!shows()) return;
  const fresh = await api(`/v1/songs/${id}`);
  if (shows()) { view.current.doc = fresh; render(); }
}

function render() {
  const current = view.current;
  const doc = current.doc;
  $("current").hidden = false;
  $("current-title").textContent = doc.label || doc.request.style.slice(0, 60) || doc.id;
  const status = $("current-status");
  status.textContent = doc.status;
  status.className = "badge " + (FINAL.has(doc.status) ? doc.status : doc.status === "queued" ? "" : "running");
  const parts = [doc.id, `cot ${doc.request.cot}`, `seed ${doc.request.seed}`];
  if (doc.queue_position !== undefined && doc.status === "queued") parts.push(`${doc.queue_position} ahead in the queue`);
  if (doc.result && doc.result.audio_seconds) parts.push(`${doc.result.audio_seconds.toFixed(1)} s of audio`);
  const cut = doc.result && doc.result.truncation && doc.result.truncation.semantic;
  if (cut) parts.push(`capped at ${minutes(cut.tokens / 25)} (${cut.by === "seconds" ? "its length" : "max tokens"})`);
  const adapters = doc.request.adapters || [];
  if (adapters.length) parts.push("adapters " + adapters.map((a) => `${a.name} ×${a.scale ?? 1}`).join(", "));
  if (doc.continued_from) parts.push(`continues ${doc.continued_from.id}` +
    (doc.continued_from.take > 1 ? ` take ${doc.continued_from.take}` : ""));
  if (doc.retries && doc.retries.length) parts.push(`retried: ${doc.retries[doc.retries.length - 1].reason}`);
  $("current-meta").textContent = parts.join(" · ");
  const cover = doc.request.transcription;  // a cover: where its score came from, its warnings and licence
  $("current-cover").hidden = !cover;
  if (cover) {
    showTranscription(cover, $("current-cover"), $("current-cover-facts"), $("current-cover-warnings"),
                      $("current-cover-licence"));
  }
  renderBars(doc);
  show($("current-error"), doc.error ? `${doc.error.type}: ${doc.error.message}` : "");
  $("cancel").hidden = FINAL.has(doc.status);
  $("render").hidden = !(doc.stage === "plan" && doc.status === "complete");
  $("resume").hidden = !(doc.status === "failed" || doc.status === "cancelled");
  renderContinue(doc);
  const plan = doc.stages.plan || {};
  const planned = plan.state === "done" || plan.state === "reused";
  if (planned && current.score === null && doc.request.cot !== "off") {
    current.score = "";
    api(doc.urls.score).then((text) => {
      if (view.current !== current) return;
      current.score = text;
      if (!showsMelody()) showScore(text, songSource(current.doc));
    }).catch((error) => {  // asked again at the next render
      if (view.current !== current) return;
      current.score = null;
      show($("current-error"), `The score did not load: ${describeError(error)}`);
    });
  }
  if (!showsMelody()) {  // a melody transcribed meanwhile stays: only select() and forget() replace it
    if (current.score) showScore(current.score, songSource(doc));  // the same score again keeps its edit
    else hideScore();
  }
  if (doc.status === "complete" && doc.stage === "audio" && $("player").hidden && !current.audioAsked) {
    current.audioAsked = true;
    showAudio(doc).catch((error) => { if (view.current === current) show($("current-error"), describeError(error)); });
  }
  renderTakes(current, { stillShown: () => view.current === current, reload });
}

// One event of song `id`'s stream into the view; true when the stream is done with (another song shown, or final).
function onEvent(id, kind, data) {
  const current = view.current;
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
    reload(id).catch((error) => {  // a 404: it was deleted
      if (error.status === 404 && view.current && view.current.id === id) forget();
    });
    songsChanged(true);
    return true;
  }
  render();
  return false;
}

function forget() {  // the shown song was deleted
  const current = view.current;
  if (current.stream) current.stream.abort();
  if (current.resultUrl) URL.revokeObjectURL(current.resultUrl);
  clearPlayer();
  hideScore();
  view.current = null;
  $("current").hidden = true;
  history.replaceState(null, "", location.pathname);
}

let selecting = 0;  // the latest select(): an earlier one still waiting for its song gives way

export async function select(id) {
  const before = view.current;
  if (before && before.stream) before.stream.abort();
  if (before && before.resultUrl) URL.revokeObjectURL(before.resultUrl);
  view.current = null;  // from here on, nothing an earlier song's requests bring back is shown
  clearPlayer();
  hideScore();
  const mine = ++selecting;
  const doc = await api(`/v1/songs/${id}`);
  if (mine !== selecting) return;
  const current = { id, doc, score: null, stream: new AbortController(), resultUrl: null, picture: null,
                    audioAsked: false };
  view.current = current;
  history.replaceState(null, "", `#${id}`);
  render();
  for (const row of document.querySelectorAll("#jobs tr")) row.classList.toggle("selected", row.dataset.id === id);
  if (!FINAL.has(doc.status)) follow(id, current.stream.signal, (kind, data) => onEvent(id, kind, data));
}

export async function act(id, action) {  // cancel, resume, render (POST) or delete (DELETE)
  const shows = () => view.current && view.current.id === id;
  try {
    if (action === "delete") {
      if (!confirm(`Delete song ${id} and its files? This cannot be undone.`)) return;
      await api(`/v1/songs/${id}`, { method: "DELETE" });
      if (shows()) forget();
    } else {
      await api(`/v1/songs/${id}/${action}`, { method: "POST" });
      if (shows()) await select(id);
    }
    songsChanged();
  } catch (error) {
    show(shows() ? $("current-error") : $("jobs-error"), describeError(error));
  }
}
