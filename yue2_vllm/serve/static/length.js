// A song's length (docs/length.md): the longest song the form's request can reach (POST /v1/songs/length, asked a
// moment after each edit), and continuing a capped song to a longer length (POST /v1/songs/{id}/continue).

import { $, api, describeError, needKey, show } from "./api.js";

export function minutes(seconds) {  // 816.68 -> "13 min 36.7 s"
  const whole = Math.floor(seconds / 60);
  const rest = seconds - 60 * whole;
  return whole ? `${whole} min ${rest.toFixed(1)} s` : `${rest.toFixed(1)} s`;
}

let asking = 0;  // the latest question: an earlier answer that comes back later is dropped
let timer = null;

// The hint under the form's length: the longest song its prompt and score budget leave room for, and, when the
// length asked does not fit, the line the server would refuse it with.
export function refreshLongest(body) {
  clearTimeout(timer);
  timer = setTimeout(async () => {
    if (needKey()) return;
    const mine = ++asking;
    let text = "";
    try {
      const answer = await api("/v1/songs/length", { method: "POST", body: body(),
        headers: { "Content-Type": "application/json" } });
      text = `The longest song this request can reach: ${minutes(answer.longest.seconds)}.`;
      if (!answer.fits) text += ` ${answer.problem}`;
    } catch (error) {  // a field the server refuses: said now, and named on the field once the song is sent
      text = error.status === 422 ? error.message : "";
    }
    if (mine === asking) show($("longest"), text);
  }, 400);
}

// The Continue control of the song in view: shown for a finished song its cap cut (result.truncated.semantic).
export function renderContinue(doc) {
  const capped = doc.status === "complete" && doc.stage === "audio" && doc.result && doc.result.truncated &&
    doc.result.truncated.semantic === true;
  $("continue-box").hidden = !capped;
  if (capped && $("continue-box").dataset.song !== doc.id) {
    $("continue-box").dataset.song = doc.id;
    $("continue-seconds").value = Math.ceil(doc.result.audio_seconds + 30);
  }
}

export async function continueSong(id, select) {
  const button = $("continue");
  button.disabled = true;
  try {
    const job = await api(`/v1/songs/${id}/continue`, { method: "POST",
      body: JSON.stringify({ seconds: Number($("continue-seconds").value) }),
      headers: { "Content-Type": "application/json" } });
    await select(job.id);
  } catch (error) {
    show($("current-error"), describeError(error));
    if (error.field === "seconds") $("continue-seconds").setAttribute("aria-invalid", "true");
  } finally {
    button.disabled = false;
  }
}
