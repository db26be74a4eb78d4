// The melody source: an audio file or a hum recorded with the microphone (MediaRecorder, re-encoded here as 16-bit
// WAV at 16 kHz: the server reads what libsndfile reads, and that is not WebM/Opus), transcribed by POST
// /v1/transcriptions with the knobs and the form's lyrics, shown in the score panel (notation, synth, the editor
// with the reader's verdict) with its warnings (the drift and its figures) and licence; the panel's render makes
// the cover: a new song from the (edited) score with the form's style, lyrics and seed, its `transcription` record
// sent along (the server works out whether the score was edited).

import { $, api, describeError, needKey, saveKey, show } from "./api.js";
import { collect } from "./form.js";
import { showScore } from "./score.js";
import { showTranscription } from "./transcribed.js";

const WAV_RATE = 16000;  // the transcriber listens at 16 kHz: a smaller upload, nothing lost
const KNOBS = { transcriber: "melody-transcriber", bpm: "melody-bpm", meter: "melody-meter", key: "melody-key",
                voice: "melody-voice" };

// audio: {blob, name} to transcribe; recorder: the MediaRecorder while recording; asked: the latest transcription
export const melody = { audio: null, recorder: null, asked: 0, answer: null };

export function wireMelody() {
  $("melody-file").addEventListener("change", () => {
    const file = $("melody-file").files[0];
    if (!file) return;
    melody.audio = { blob: file, name: file.name };
    transcribe();
  });
  $("melody-record").addEventListener("click", () => toggleRecording().catch((error) => {
    show($("melody-error"), `The microphone: ${error.message}`);
    stopped();
  }));
  $("melody-transcribe").addEventListener("click", transcribe);
  for (const id of Object.values(KNOBS)) $(id).addEventListener("input", () => $(id).removeAttribute("aria-invalid"));
}

async function toggleRecording() {
  if (melody.recorder) { melody.recorder.stop(); return; }
  show($("melody-error"), "");
  const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  const recorder = new MediaRecorder(stream);
  const chunks = [];
  const started = performance.now();
  const clock = setInterval(() => {
    $("melody-recording").textContent = `recording… ${((performance.now() - started) / 1000).toFixed(0)} s`;
  }, 250);
  recorder.addEventListener("dataavailable", (event) => { if (event.data.size) chunks.push(event.data); });
  recorder.addEventListener("stop", async () => {
    clearInterval(clock);
    for (const track of stream.getTracks()) track.stop();
    stopped();
    try {
      const recorded = new Blob(chunks, { type: recorder.mimeType });
      melody.audio = { blob: await wavOf(recorded), name: "recording.wav" };
      $("melody-recording").textContent = `recorded ${((performance.now() - started) / 1000).toFixed(1)} s`;
      await transcribe();
    } catch (error) {
      show($("melody-error"), `The recording could not be read: ${error.message}`);
    }
  });
  melody.recorder = recorder;
  recorder.start(250);
  $("melody-record").textContent = "■ Stop";
  $("melody-record").classList.add("recording");
}

function stopped() {
  melody.recorder = null;
  $("melody-record").textContent = "● Record";
  $("melody-record").classList.remove("recording");
}

// A recording (whatever MediaRecorder made) as a mono 16-bit PCM WAV at WAV_RATE: decoded (and resampled) by
// WebAudio, the channels mixed.
async function wavOf(blob) {
  const context = new OfflineAudioContext(1, 1, WAV_RATE);
  const buffer = await context.decodeAudioData(await blob.arrayBuffer());
  const mono = new Float32Array(buffer.length);
  for (let channel = 0; channel < buffer.numberOfChannels; channel += 1) {
    const data = buffer.getChannelData(channel);
    for (let i = 0; i < data.length; i += 1) mono[i] += data[i] / buffer.numberOfChannels;
  }
  const bytes = new DataView(new ArrayBuffer(44 + mono.length * 2));
  const text = (offset, value) => { for (let i = 0; i < value.length; i += 1) bytes.setUint8(offset + i, value.charCodeAt(i)); };
  text(0, "RIFF"); bytes.setUint32(4, 36 + mono.length * 2, true); text(8, "WAVE");
  text(12, "fmt "); bytes.setUint32(16, 16, true); bytes.setUint16(20, 1, true); bytes.setUint16(22, 1, true);
  bytes.setUint32(24, buffer.sampleRate, true); bytes.setUint32(28, buffer.sampleRate * 2, true);
  bytes.setUint16(32, 2, true); bytes.setUint16(34, 16, true);
  text(36, "data"); bytes.setUint32(40, mono.length * 2, true);
  for (let i = 0; i < mono.length; i += 1) {
    const sample = Math.max(-1, Math.min(1, mono[i]));
    bytes.setInt16(44 + i * 2, Math.round(sample * 32767), true);
  }
  return new Blob([bytes.buffer], { type: "audio/wav" });
}

function clearInvalid() {
  for (const id of Object.values(KNOBS)) $(id).removeAttribute("aria-invalid");
}

export async function transcribe() {
  if (!melody.audio) return;
  saveKey();
  clearInvalid();
  show($("melody-error"), "");
  if (needKey()) { show($("melody-error"), "This server needs its API key: enter it under Advanced."); return; }
  const form = new FormData();
  form.append("audio", melody.audio.blob, melody.audio.name);
  for (const [name, id] of Object.entries(KNOBS)) {
    const value = $(id).value.trim();
    if (value !== "" && !(name === "transcriber" && value === "pyin")) form.append(name, value);
  }
  if ($("lyrics").value.trim()) form.append("lyrics", $("lyrics").value);
  const asked = ++melody.asked;
  $("melody-transcribe").disabled = true;
  $("melody-status").textContent = `Transcribing ${melody.audio.name}…`;
  try {
    const answer = await api("/v1/transcriptions", { method: "POST", body: form });
    if (asked !== melody.asked) return;
    melody.answer = answer;
    $("melody-status").textContent = "";
    showTranscription(answer.transcription, $("melody-result"), $("melody-facts"), $("melody-warnings"),
                      $("melody-licence"));
    showScore(answer.abc, melodySource(answer));
  } catch (error) {
    if (asked !== melody.asked) return;
    $("melody-status").textContent = "";
    show($("melody-error"), describeError(error));
    const control = error.field && $(KNOBS[error.field] || "");
    if (control) { control.setAttribute("aria-invalid", "true"); control.focus(); }
  } finally {
    if (asked === melody.asked) $("melody-transcribe").disabled = !melody.audio;
  }
}

// The transcription as the score panel's source: no files on the server (downloads come from the text); a render
// is the form's song with this score, its cot and the transcription's record.
function melodySource(answer) {
  const record = answer.transcription;
  return {
    key: `melody:${record.source.sha256}:${record.score_sha256}`, label: "melody", abcUrl: null, midiUrl: null,
    describe: (cot) => `a cover: a new song from this melody with the form's style, lyrics and seed, cot ${cot}`,
    body: async (abc, cot) => collect({ abc, cot, transcription: record, stage: undefined, instrumental: undefined }),
  };
}
