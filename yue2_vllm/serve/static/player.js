// The streaming player: <audio> at a URL it plays directly, the playhead over the song's picture, seeking.

import { $, api } from "./api.js";

// A URL the <audio> element plays directly (Range requests: it starts before the download ends). With an API key
// it is a short-lived signed URL (GET …/audio-url), since the element cannot send the key.
async function playableUrl(doc) {
  return (await api(`${doc.urls.self}/audio-url`)).url;
}

// Play `doc`'s audio in `audio` while `stillShown()`; a signed URL that expired mid-song is renewed where it was.
export async function streamInto(audio, doc, stillShown) {
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

// `pictureSeconds()`: the shown picture's duration (0 when none), for before the audio's metadata is in.
export function movePlayhead(pictureSeconds) {
  const audio = $("audio");
  const duration = audio.duration || pictureSeconds() || 0;
  $("played").style.width = duration ? `${Math.min(100, 100 * audio.currentTime / duration)}%` : "0";
}

function seekTo(fraction, pictureSeconds) {
  const audio = $("audio");
  const duration = audio.duration || pictureSeconds() || 0;
  if (!duration) return;
  audio.currentTime = Math.max(0, Math.min(1, fraction)) * duration;
  movePlayhead(pictureSeconds);
}

export function clearPlayer() {  // nothing of the song shown before stays in the view
  const audio = $("audio");
  audio.onerror = null;
  audio.removeAttribute("src");
  delete audio.dataset.song;
  audio.load();
  $("player").hidden = true;
  $("picture").hidden = true;
  delete $("picture").dataset.song;
}

// The picture seeks (a click, the arrow keys, Home, End) and the playhead follows the audio.
export function wirePlayer(pictureSeconds) {
  const audio = $("audio"), picture = $("picture");
  picture.addEventListener("click", (event) => {
    const box = picture.getBoundingClientRect();
    seekTo((event.clientX - box.left) / box.width, pictureSeconds);
  });
  picture.addEventListener("keydown", (event) => {
    const duration = audio.duration || 0;
    const step = { ArrowLeft: -5, ArrowRight: 5, Home: -Infinity, End: Infinity }[event.key];
    if (step === undefined || !duration) return;
    event.preventDefault();
    seekTo((Math.max(0, Math.min(duration, audio.currentTime + step))) / duration, pictureSeconds);
  });
  const follow = () => movePlayhead(pictureSeconds);
  for (const kind of ["timeupdate", "seeked", "loadedmetadata"]) audio.addEventListener(kind, follow);
  audio.addEventListener("play", function tick() {  // smoother than timeupdate while it plays
    follow();
    if (!audio.paused) requestAnimationFrame(tick);
  });
}
