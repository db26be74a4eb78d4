// Takes side by side: each take's card (seed, signal, its own player and waveform), keep one, delete another.

import { $, FINAL, api, describeError, show } from "./api.js";
import { drawPictureInto, fetchPicture } from "./picture.js";
import { streamInto } from "./player.js";

export function takesOf(value) {  // the form's take count: takes > 1 are sent with best_of (the pick is marked)
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
async function loadTake(card, entry, stillShown) {
  const cardShown = () => stillShown() && card.isConnected;
  const take = { id: entry.id, urls: { self: `/v1/songs/${entry.id}` } };
  const audio = card.querySelector("audio");
  if (await streamInto(audio, take, cardShown) === null) return;
  const picture = await fetchPicture(take, cardShown);
  if (picture) drawPictureInto({ ...picture, spectrogram: null }, card.querySelector("canvas"), null);
}

async function takeAction(id, take, action, reload) {  // keep (POST) or delete (DELETE) one take
  try {
    if (action === "delete") {
      if (!confirm(`Delete take ${take} of song ${id} and its files? This cannot be undone.`)) return;
      await api(`/v1/songs/${id}/takes/${take}`, { method: "DELETE" });
    } else {
      await api(`/v1/songs/${id}/takes/${take}/keep`, { method: "POST" });
    }
    await reload(id);
  } catch (error) {
    show($("current-error"), describeError(error));
  }
}

function takeCard(doc, entry, song) {
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
  keep.addEventListener("click", () => takeAction(doc.id, entry.take, "keep", song.reload));
  remove.addEventListener("click", () => takeAction(doc.id, entry.take, "delete", song.reload));
  if (entry.status === "complete" && doc.stage === "audio") {
    loadTake(card, entry, song.stillShown).catch((error) => console.warn(error.message));
  }
  return card;
}

// The takes of `shown` (the song in view: {id, doc, takesDrawn, takesTimer}); `song.stillShown()` is false once the
// view moved on, `song.reload(id)` fetches the song again and draws it if still shown.
export function renderTakes(shown, song) {
  const doc = shown.doc;
  const takes = doc.takes && doc.takes.entries ? doc.takes : null;
  $("takes-box").hidden = !takes;
  if (!takes) return;
  const entries = takes.entries.filter((entry) => entry.status !== "deleted");
  const drawn = JSON.stringify([entries.map((e) => [e.take, e.status]), takes.kept, takes.pick]);
  if (shown.takesDrawn !== drawn) {  // redrawn only when a take changed (players keep playing otherwise)
    shown.takesDrawn = drawn;
    const list = $("takes-list");
    list.textContent = "";
    for (const entry of entries) list.appendChild(takeCard(doc, entry, song));
  }
  clearTimeout(shown.takesTimer);
  if (entries.some((entry) => !FINAL.has(entry.status))) {  // the job's stream is take 1's: poll for the others
    shown.takesTimer = setTimeout(() => song.reload(doc.id).catch(() => {}), 1000);
  }
}
