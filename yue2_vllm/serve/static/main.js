// yue2-vllm's page: submit a song, follow it live (SSE over fetch, so an API key can be sent), play it.
// The modules: api (fetch, key, errors), form, song (the song in view), stream (its events), player, picture,
// takes, jobs (the list and health), adapters (the server's, picked with a scale), score (a score as music: notation,
// synth, the reader's verdict as you edit, a new song from the edit), melody (a hum or a file transcribed into the
// score panel, rendered as a cover), transcribed (a transcription's record shown); this one wires them to the page.

import { loadAdapters } from "./adapters.js";
import { $, auth, needKey, saveKey, show } from "./api.js";
import { collect, randomSeed, submit } from "./form.js";
import { forgetListed, refreshHealth, refreshJobs } from "./jobs.js";
import { continueSong, refreshLongest } from "./length.js";
import { wireMelody } from "./melody.js";
import { wirePlayer } from "./player.js";
import { wireScore } from "./score.js";
import { act, drawPicture, pictureSeconds, select, view } from "./song.js";
import { synth } from "./synth.js";

// The song in view, as `current` from the console (and the page test), as when the page was one script.
Object.defineProperty(window, "current", { get: () => view.current });
// The score's synth (its AudioContext and the notes it started), for the same.
Object.defineProperty(window, "scoreSynth", { get: () => synth });

function start() {
  $("api-key").value = auth.key;
  $("song-form").addEventListener("submit", submit);
  $("song-form").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("song-form").requestSubmit();
  });
  $("song-form").addEventListener("input", (event) => {
    event.target.removeAttribute("aria-invalid");
    refreshLongest(collect);
  });
  $("continue").addEventListener("click", () => view.current && continueSong(view.current.id, select));
  $("continue-seconds").addEventListener("input", () => $("continue-seconds").removeAttribute("aria-invalid"));
  $("random-seed").addEventListener("click", () => { $("seed").value = randomSeed(); });
  $("instrumental").addEventListener("change", () => { $("lyrics").required = !$("instrumental").checked; });
  for (const action of ["cancel", "render", "resume", "delete"]) {
    $(action).addEventListener("click", () => view.current && act(view.current.id, action));
  }
  $("refresh").addEventListener("click", refreshJobs);
  wirePlayer(pictureSeconds);
  wireScore({ opened: async (id) => { await select(id); refreshJobs(); } });
  wireMelody();
  let resized = null;
  window.addEventListener("resize", () => { clearTimeout(resized); resized = setTimeout(drawPicture, 100); });
  $("api-key").addEventListener("change", () => {
    saveKey(); show($("jobs-error"), ""); forgetListed(); refreshJobs(); loadAdapters();
  });
  document.addEventListener("songs-changed", (event) => {
    refreshJobs();
    if (event.detail.health) refreshHealth();
  });
  setInterval(() => { if (!document.hidden) { refreshHealth(); refreshJobs(); } }, 4000);
  refreshHealth().then(() => {  // whether a key is needed is known before anything under /v1 is asked
    refreshJobs();
    refreshLongest(collect);
    if (!needKey()) loadAdapters();
    const id = location.hash.slice(1);
    if (/^j[0-9a-f]{20}$/.test(id) && !needKey()) {
      select(id).catch(() => history.replaceState(null, "", location.pathname));
    }
  });
}

// Modules run deferred, before DOMContentLoaded: the page starts there, as the single script did.
document.addEventListener("DOMContentLoaded", start);
